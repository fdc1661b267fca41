"""The code predictors of the Qwen3 talkers (Qwen3-Omni, Qwen3-TTS): one talker frame -> its
residual codebooks 1..G-1. Shared by both families (each keeps its own module and weights).

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

from vllm_omni.model_executor.layers.linear import linear
from vllm_omni.model_executor.layers.rotary import apply_rotary_emb, get_rope
from vllm_omni.model_executor.models.decoder import DecoderAttention, DecoderModel, config_head_dim
from vllm_omni.model_executor.models.qwen3 import make_qwen3_layer

# (logits [B, vocab] in the model dtype, group) -> codes [B]: the talker's sampling of its requests.
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


class FrameCacheAttention(nn.Module):
    """A code predictor layer's self-attention: B equally long sequences, causal, over a dense
    cache kept for one call.

    Replaces the decoder layer's `self_attn` (whose paged `Attention` the model runner would
    find and give KV blocks) and keeps its projections and per-head norms, so the parameter
    names stay. Tokens arrive packed sequence-major ([b0 t0, b0 t1, b1 t0, ...]) like the
    decoder's other inputs. On CUDA the norms, rotary, cache write and attention are one kernel
    (`cuda_ops.frame_attention`): a frame runs G passes of a few layers at a handful of rows,
    where each launch costs more than its work.
    """

    def __init__(self, attn: DecoderAttention, capacity: int):
        super().__init__()
        self.qkv_proj, self.o_proj, self.q_norm, self.k_norm = attn.qkv_proj, attn.o_proj, attn.q_norm, attn.k_norm
        self.num_heads, self.head_dim, self.num_kv_heads = attn.num_heads, attn.head_dim, attn.num_kv_heads
        self.scale = self.head_dim**-0.5
        self.capacity = capacity  # positions per sequence: a whole frame
        self.batch = self.length = 0
        self.k_cache: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self.v_cache: torch.Tensor | None = None

    def reset(self, batch: int) -> None:
        """Start B new sequences (0: free the cache)."""
        self.batch, self.length, self.k_cache, self.v_cache = batch, 0, None, None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B*T, hidden], cos/sin [B*T, D] -> [B*T, hidden]."""
        return self.attend(*self.qkv_proj(x), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """The rest of `forward` from the q/k/v product's output (as `DecoderAttention.attend`)."""
        if self.k_cache is None:
            self.k_cache = k.new_empty(self.batch, self.num_kv_heads, self.capacity, self.head_dim)
            self.v_cache = torch.empty_like(self.k_cache)
        start, tokens = self.length, q.shape[0] // self.batch
        self.length += tokens
        attend = self._attend_fused if q.is_cuda else self._attend
        return self.o_proj(attend(q, k, v, cos, sin, start, tokens))

    def _attend_fused(self, q, k, v, cos, sin, start: int, tokens: int) -> torch.Tensor:
        from vllm_omni.model_executor.layers import cuda_ops

        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        return cuda_ops.frame_attention(q, k, v, *norms, eps, cos, sin, self.k_cache, self.v_cache, start, self.scale)

    def _attend(self, q, k, v, cos, sin, start: int, tokens: int) -> torch.Tensor:
        n, b = q.shape[0], self.batch
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        end = start + tokens
        self.k_cache[:, :, start:end] = k.view(b, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        self.v_cache[:, :, start:end] = v.view(b, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # A multi-token chunk only ever comes first (the prefill): SDPA's causal mask is
        # top-left aligned, which is right only without earlier keys.
        causal = tokens > 1
        assert not (causal and start), "only single-token steps may follow the prefill"
        q = q.view(b, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], is_causal=causal,
                                             scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2).reshape(n, self.num_heads * self.head_dim)


def frame_decoder(config: PretrainedConfig) -> tuple[DecoderModel, list[FrameCacheAttention]]:
    """A code predictor's decoder stack (Qwen3 layers, plain RoPE over the G+1 positions of a
    frame, no token embedding: each group has its own table) and its layers' frame attentions."""
    model = DecoderModel(config, lambda i: make_qwen3_layer(config, i))
    del model.embed_tokens
    frame_len = config.num_code_groups + 1
    # Positions never exceed the frame length; no table of max_position_embeddings rows.
    model.rotary_emb = get_rope(config_head_dim(config), config.rope_parameters, frame_len)
    attention = []
    for layer in model.layers:
        layer.self_attn = FrameCacheAttention(layer.self_attn, frame_len)
        attention.append(layer.self_attn)
    return model, attention


def predict_frame(model: DecoderModel, attention: list[FrameCacheAttention], lm_head: nn.ModuleList,
                  embed: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, batch: int,
                  sample: SampleFn) -> tuple[torch.Tensor, torch.Tensor]:
    """The G-1 residual groups of B frames from their 2-token prefill `x` [2B, hidden]:
    `embed(group, codes)` -> (embedding kept for the talker, the predictor's next input row).
    Returns (codes [B, G-1], embeddings [B, G-1, ...])."""
    for attn in attention:
        attn.reset(batch)
    positions = torch.arange(2, device=x.device).repeat(batch)
    codes, embeds = [], []
    try:
        for group in range(len(lm_head)):
            hidden, _ = model(None, positions, x)
            last = hidden.view(batch, -1, hidden.shape[-1])[:, -1]
            # Matmul in the model dtype like HF's lm_head; the samplers read it in float32.
            code = sample(linear(last, lm_head[group].weight), group)
            embed_row, x = embed(group, code)
            codes.append(code)
            embeds.append(embed_row)
            positions = torch.full((batch,), group + 2, device=x.device, dtype=torch.long)
    finally:
        for attn in attention:
            attn.reset(0)  # frees the per-call cache
    return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)
