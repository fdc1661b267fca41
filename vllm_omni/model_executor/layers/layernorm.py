"""RMSNorm with the numerics of transformers' Qwen2RMSNorm / Qwen3RMSNorm.

The reduction runs in float32, the normalized value is cast back to the input
dtype *before* the weight multiply (HF order; multiplying in float32 first gives
different bf16 results).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_omni.model_executor.layers.linear import default_weight_loader, set_loader


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_loader(self.weight, default_weight_loader)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual).

        The add happens in the input dtype, as HF's `residual + hidden_states` does,
        so the residual stream is bit-identical to the reference.
        """
        if x.is_cuda and x.stride(-1) == 1:
            from vllm_omni.model_executor.layers import cuda_ops

            return cuda_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def then_linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual), weight, bias), x + residual) in one CUDA kernel, for the rows
        `linear.fuses_norm` admits; `gated`: silu(gate) * up of the [gate | up] product. Without
        `residual`, x itself is the residual stream."""
        from vllm_omni.model_executor.layers import cuda_ops

        if residual is None:
            return cuda_ops.norm_linear(x, self.weight, self.eps, weight, bias, gated=gated), x
        return cuda_ops.norm_linear(x, self.weight, self.eps, weight, bias, residual, gated)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
