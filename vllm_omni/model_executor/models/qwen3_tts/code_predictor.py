"""Qwen3-TTS code predictor: one talker frame -> its residual code groups 1..G-1.

qwen-tts runs it as a `generate` per talker step: a 2-token prefill [the talker's final
hidden state of the frame, the talker codec embedding of the frame's group-0 code], then one
token per group; group j comes from `lm_head[j-1]` and is fed back through
`codec_embedding[j-1]`. Unlike Qwen3-Omni's predictor, the embeddings are talker-wide and
`small_to_mtp_projection` maps every input row to the predictor's width.

Every frame is exactly G+1 tokens, so a batch of frames runs densely with a cache that lives
for one call (the shared `frame_predictor.frame_decoder` and `predict_frame`).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding
from vllm_omni.model_executor.models.frame_predictor import SampleFn, frame_decoder, predict_frame


class Qwen3TTSCodePredictor(nn.Module):
    """qwen-tts `talker.code_predictor` (parameter names match below `code_predictor.`)."""

    def __init__(self, config, talker_hidden: int):
        super().__init__()
        self.num_code_groups = config.num_code_groups
        model, self.attention = frame_decoder(config)
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
        x = self._project(torch.stack([frame_hidden, first_embeds], dim=1).reshape(-1, width))

        def embed(group: int, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            row = self.model.codec_embedding[group](code)
            return row, self._project(row)

        return predict_frame(self.model, self.attention, self.lm_head, embed, x, batch, sample)

    def embed_codes(self, codes: torch.Tensor, first_table: nn.Module) -> torch.Tensor:
        """codes [T, G] -> [T, H_talker]: the sum of every group's embedding (group 0 through the
        talker's codec table), the talker's input row of a frame."""
        rows = [first_table(codes[:, 0])]
        rows += [self.model.codec_embedding[g - 1](codes[:, g]) for g in range(1, self.num_code_groups)]
        return torch.stack(rows, dim=1).sum(1)  # qwen-tts' summation order, bit for bit
