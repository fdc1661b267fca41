"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] laid out [gate | up] -> silu(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
            from vllm_omni.model_executor.layers import cuda_ops

            return cuda_ops.silu_and_mul(x)
        return silu_and_mul(x)


def get_gated_act(hidden_act: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name (the Qwen family uses "silu")."""
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: ['silu']")
    return SiluAndMul()
