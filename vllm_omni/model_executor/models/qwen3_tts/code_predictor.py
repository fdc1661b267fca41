"""Qwen3-TTS code predictor: one talker frame -> its residual code groups 1..G-1.

qwen-tts runs it as a `generate` per talker step: a 2-token prefill [the talker's final
hidden state of the frame, the talker codec embedding of the frame's group-0 code], then one
token per group; group j comes from `lm_head[j-1]` and is fed back through
`codec_embedding[j-1]`. Unlike Qwen3-Omni's predictor, the embeddings are talker-wide and
`small_to_mtp_projection` maps every input row to the predictor's width.

Every frame is exactly G+1 tokens, so a batch of frames runs densely with a cache that lives
for one call (Qwen3-Omni's `FrameCacheAttention`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding
from vllm_omni.model_executor.layers.rotary import get_rope
from vllm_omni.model_executor.models.decoder import DecoderModel, config_head_dim
from vllm_omni.model_executor.models.qwen3 import make_qwen3_layer
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code_predictor import FrameCacheAttention

# (logits [B, vocab] float32, group index) -> codes [B]
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


class Qwen3TTSCodePredictor(nn.Module):
    """qwen-tts `talker.code_predictor` (parameter names match below `code_predictor.`)."""

    def __init__(self, config, talker_hidden: int):
        super().__init__()
        self.num_code_groups = config.num_code_groups
        model = DecoderModel(config, lambda i: make_qwen3_layer(config, i))
        del model.embed_tokens  # each group has its own table (codec_embedding below)
        model.rotary_emb = get_rope(config_head_dim(config), config.rope_parameters, self.num_code_groups + 1)
        self.attention = []
        for layer in model.layers:
            attn = layer.self_attn
            attn.attn = FrameCacheAttention(attn.num_heads, attn.head_dim, attn.num_kv_heads)
            self.attention.append(attn.attn)
        num_residual = self.num_code_groups - 1
        model.codec_embedding = nn.ModuleList(VocabEmbedding(config.vocab_size, talker_hidden)
                                              for _ in range(num_residual))
        self.model = model
        self.lm_head = nn.ModuleList(Linear(config.hidden_size, config.vocab_size) for _ in range(num_residual))
        self.small_to_mtp_projection = (Linear(talker_hidden, config.hidden_size, bias=True)
                                        if config.hidden_size != talker_hidden else None)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def forward(self, frame_hidden: torch.Tensor, first_embeds: torch.Tensor,
                sample: SampleFn) -> tuple[torch.Tensor, torch.Tensor]:
        """frame_hidden, first_embeds: [B, H_talker]. Returns (codes [B, G-1] of groups
        1..G-1, their talker-wide embeddings [B, G-1, H_talker])."""
        batch, width = frame_hidden.shape
        for attn in self.attention:
            attn.reset(batch)
        device = frame_hidden.device
        x = self._project(torch.stack([frame_hidden, first_embeds], dim=1).reshape(-1, width))
        positions = torch.arange(2, device=device).repeat(batch)
        codes, embeds = [], []
        try:
            for group in range(self.num_code_groups - 1):
                hidden, _ = self.model(None, positions, x)
                last = hidden.view(batch, -1, hidden.shape[-1])[:, -1]
                code = sample(F.linear(last, self.lm_head[group].weight).float(), group)
                embed = self.model.codec_embedding[group](code)
                codes.append(code)
                embeds.append(embed)
                x = self._project(embed)
                positions = torch.full((batch,), group + 2, device=device, dtype=torch.long)
        finally:
            for attn in self.attention:
                attn.reset(0)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)

    def embed_codes(self, codes: torch.Tensor, first_table: nn.Module) -> torch.Tensor:
        """codes [T, G] -> [T, H_talker]: the sum of every group's embedding (group 0 through the
        talker's codec table), the talker's input row of a frame."""
        rows = [first_table(codes[:, 0])]
        rows += [self.model.codec_embedding[g - 1](codes[:, g]) for g in range(1, self.num_code_groups)]
        return torch.stack(rows, dim=1).sum(1)  # qwen-tts' summation order, bit for bit
