"""FP8 (W8A8) linear layers for the diffusion transformers (`--diffusion-quantization-config
'{"method": "fp8"}'` and ModelOpt FP8 checkpoints).

Weights are stored as float8_e4m3fn with one float32 scale per output channel (absmax / 448);
activations are quantized per token (per row) on the fly, or with a checkpoint's static
per-tensor scale. The product is

    y = (q(x) * s_x) @ (q(W) * s_W)^T + b

computed two ways, with the same quantized operands:

- `torch._scaled_mm` (cuBLASLt's FP8 GEMM, the CUTLASS-class kernel path; fp8 products
  accumulated in float32, scales applied in the epilogue) on CUDA GPUs with FP8 tensor cores
  (compute capability 8.9+: Ada, Hopper, Blackwell) for bfloat16 activations;
- everywhere else the operands are dequantized to float32 and multiplied (the reference path:
  the same quantization, so CPU tests exercise the numbers the GPU computes, up to the order
  of the float32 sums).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel gets this scale instead of 0 (no division by 0)
# _scaled_mm needs both GEMM dimensions in multiples of 16 (cuBLASLt's FP8 layout rules).
_SCALED_MM_ALIGN = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8 [..., K], float32 scale [..., 1]): one absmax scale per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return to_fp8(x, scale), scale


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to the float8_e4m3fn range (which has no infinity)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_gemm_problem(device: torch.device) -> str | None:
    """Why `torch._scaled_mm` cannot run FP8 GEMMs on `device` (None: it can)."""
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU (the stage runs on {device.type})"
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 tensor cores "
                "(8.9+: Ada, Hopper, Blackwell)")
    return None


class Fp8Linear(nn.Module):
    """nn.Linear's y = x W^T + b with float8 weights and per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
                 input_scale: torch.Tensor | None = None, use_scaled_mm: bool = False) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"an FP8 weight is a 2-d {FP8_DTYPE} tensor, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        # Per-tensor (a scalar) or per-channel ([out] or ModelOpt's [out, 1]) scales, kept per channel.
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1).expand(self.out_features).contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        aligned = self.in_features % _SCALED_MM_ALIGN == 0 and self.out_features % _SCALED_MM_ALIGN == 0
        self.use_scaled_mm = use_scaled_mm and aligned

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, use_scaled_mm: bool = False) -> Fp8Linear:
        """Quantize a linear layer's weight per output channel (online FP8)."""
        weight, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale.reshape(-1), bias, use_scaled_mm=use_scaled_mm)

    def dequantized_weight(self) -> torch.Tensor:
        """W as float32: what the quantized weight stands for."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is None:
            xq, x_scale = quantize_rows(rows)
        else:  # a checkpoint's static per-tensor activation scale
            xq = to_fp8(rows, self.input_scale)
            x_scale = self.input_scale.expand(rows.shape[0], 1)
        if self.use_scaled_mm and x.dtype == torch.bfloat16:
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale.contiguous(),
                                   scale_b=self.weight_scale.view(1, -1), out_dtype=x.dtype)
        else:
            out = (xq.float() * x_scale) @ self.dequantized_weight().t()
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "scaled_mm" if self.use_scaled_mm else "dequantized"
        activations = "static" if self.input_scale is not None else "per-token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activations={activations}, kernel={kernel}")


def quantize_linears(root: nn.Module, *, use_scaled_mm: bool, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Replace every nn.Linear under `root` (except those `skip` names) by its Fp8Linear; the count."""
    targets = [(name, module) for name, module in root.named_modules()
               if isinstance(module, nn.Linear) and not skip(name)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, Fp8Linear.from_linear(linear, use_scaled_mm=use_scaled_mm))
    return len(targets)
