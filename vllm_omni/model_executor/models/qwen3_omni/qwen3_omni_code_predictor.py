"""Qwen3-Omni talker's code predictor (models/frame_predictor.py runs its frames)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding
from vllm_omni.model_executor.models.frame_predictor import SampleFn, frame_decoder, predict_frame


class Qwen3OmniMoeCodePredictor(nn.Module):
    """HF `talker.code_predictor` (parameter names match below `code_predictor.`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_code_groups = config.num_code_groups
        model, self.attention = frame_decoder(config)
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
        x = torch.stack([frame_hidden, first_embeds], dim=1).reshape(-1, hidden_size)

        def embed(group: int, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            row = self.model.codec_embedding[group](code)
            return row, row

        return predict_frame(self.model, self.attention, self.lm_head, embed, x, batch, sample)
