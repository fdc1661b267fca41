"""Small MLPs several models share."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.linear import Linear


class ResizeMLP(nn.Module):
    """transformers' Qwen3OmniMoeTalkerResizeMLP (Qwen3-TTS's text projection too): one width ->
    another through a SiLU hidden layer, with biases."""

    def __init__(self, in_size: int, mid_size: int, out_size: int, hidden_act: str):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported talker hidden_act {hidden_act!r}; supported: ['silu']")
        self.linear_fc1 = Linear(in_size, mid_size, bias=True)
        self.linear_fc2 = Linear(mid_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))
