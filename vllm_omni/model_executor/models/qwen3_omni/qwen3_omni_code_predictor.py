"""Qwen3-Omni talker's code predictor: one talker frame -> its residual codebooks 1..G-1.

transformers runs it as a separate `generate` at every talker step
(`Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation`): a 2-token
prefill [talker's final hidden state of the frame, talker codec embedding of the frame's
group-0 code], then one token per step; group j (1 <= j < G) comes from `lm_head[j-1]` and is
fed back through `codec_embedding[j-1]`. The decoder is a small dense Qwen3 stack with plain
RoPE (positions 0..G).

Every frame is exactly G+1 tokens long, so the frames of a whole batch run as one dense
[B, tokens] problem with a KV cache that lives for one call: no paged cache, no scheduler.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding
from vllm_omni.model_executor.layers.rotary import apply_rotary_emb, get_rope
from vllm_omni.model_executor.models.decoder import DecoderModel, config_head_dim
from vllm_omni.model_executor.models.qwen3 import make_qwen3_layer

# logits [B, vocab] (float32) -> codes [B]: the talker's sampling of its requests.
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


class FrameCacheAttention(nn.Module):
    """Causal attention of B equally long sequences over a dense cache kept for one call.

    Replaces the decoder's paged `Attention` (which the model runner would find and give KV
    blocks). Tokens arrive packed sequence-major ([b0 t0, b0 t1, b1 t0, ...]) like the
    decoder's other inputs.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = head_dim**-0.5
        self.batch = 0
        self.k: torch.Tensor | None = None  # [B, Hkv, S, D]
        self.v: torch.Tensor | None = None

    def reset(self, batch: int) -> None:
        self.batch, self.k, self.v = batch, None, None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`Attention`'s interface: q [T, H*D], k/v [T, Hkv*D], rotary = (cos, sin) [T, D]."""
        b, n = self.batch, q.shape[0]
        t = n // b
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q, k = apply_rotary_emb(q, *rotary), apply_rotary_emb(k, *rotary)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # A multi-token chunk only ever comes first (the prefill): SDPA's causal mask is
        # top-left aligned, which is right only without earlier keys.
        causal = t > 1
        if self.k is not None:
            assert not causal, "only single-token steps may follow the prefill"
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim)


class Qwen3OmniMoeCodePredictor(nn.Module):
    """HF `talker.code_predictor` (parameter names match below `code_predictor.`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_code_groups = config.num_code_groups
        head_dim = config_head_dim(config)
        model = DecoderModel(config, lambda i: make_qwen3_layer(config, i))
        del model.embed_tokens  # each group has its own table (codec_embedding below)
        # Positions never exceed the frame length; no table of max_position_embeddings rows.
        model.rotary_emb = get_rope(head_dim, config.rope_parameters, self.num_code_groups + 1)
        self.attention = []
        for layer in model.layers:
            attn = layer.self_attn
            attn.attn = FrameCacheAttention(attn.num_heads, attn.head_dim, attn.num_kv_heads)
            self.attention.append(attn.attn)
        num_residual = self.num_code_groups - 1
        model.codec_embedding = nn.ModuleList(
            VocabEmbedding(config.vocab_size, config.hidden_size) for _ in range(num_residual))
        self.model = model
        self.lm_head = nn.ModuleList(Linear(config.hidden_size, config.vocab_size) for _ in range(num_residual))

    def forward(self, frame_hidden: torch.Tensor, first_embeds: torch.Tensor,
                sample: SampleFn) -> tuple[torch.Tensor, torch.Tensor]:
        """frame_hidden, first_embeds: [B, H] (the talker's final hidden state that produced
        each frame's group-0 code, and that code's talker embedding).

        Returns (codes [B, G-1] of groups 1..G-1, their embeddings [B, G-1, H]); the talker's
        next input sums the group-0 embedding and these (transformers' `codec_hiddens`).
        """
        batch, hidden_size = frame_hidden.shape
        for attn in self.attention:
            attn.reset(batch)
        device = frame_hidden.device
        x = torch.stack([frame_hidden, first_embeds], dim=1).reshape(-1, hidden_size)
        positions = torch.arange(2, device=device).repeat(batch)
        codes, embeds = [], []
        try:
            for group in range(self.num_code_groups - 1):
                hidden, _ = self.model(None, positions, x)
                last = hidden.view(batch, -1, hidden_size)[:, -1]
                # Matmul in the model dtype like HF's lm_head; transformers samples in float32.
                code = sample(F.linear(last, self.lm_head[group].weight).float(), group)
                x = self.model.codec_embedding[group](code)
                codes.append(code)
                embeds.append(x)
                positions = torch.full((batch,), group + 2, device=device, dtype=torch.long)
        finally:
            for attn in self.attention:
                attn.reset(0)  # frees the per-call cache
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)
