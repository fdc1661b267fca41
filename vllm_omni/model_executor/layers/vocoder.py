"""Causal convolution blocks of the codec vocoders (Qwen3-TTS's 12 Hz decoder, Qwen3-Omni's
code2wav: the same layers, the parameter names of both checkpoints).

Between its convolutions such a vocoder is memory-bound: each activation, causal pad and
bias add reads and writes the whole signal. So a SnakeBeta in front of a stride-1 causal conv
writes the conv's left padding itself (`CausalConv(x, activation)`), and on CUDA, where cuDNN
adds a conv's bias in a pass of its own, a residual unit has the next kernel add it instead
(the SnakeBeta after its first conv, the residual sum after its second): the same bits, three
passes fewer per unit. A transposed conv (kernel a multiple of its stride) runs on CUDA as one
GEMM and an overlap-add: cuDNN's kernels for it ran up to ~13x above their FLOP floor on the H200.
`VLLM_OMNI_FUSED_VOCODER=0` keeps torch's ops (A/B runs).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.activation import SnakeBeta, fused_vocoder


class CausalConv(nn.Module):
    """Conv1d padded on the left (and right up to a whole number of strides)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.left = self.span - stride

    def forward(self, x: torch.Tensor, activation: SnakeBeta | None = None, bias: bool = True) -> torch.Tensor:
        """conv(pad(activation(x))), without its bias if asked. With stride 1 the right padding
        is always 0, and the activation writes the left padding."""
        if activation is not None and self.stride == 1:
            return self._conv(activation(x, left_pad=self.left), bias)
        if activation is not None:
            x = activation(x)
        length = x.shape[-1]
        frames = math.ceil((length - self.span + self.left) / self.stride + 1)
        right = (frames - 1) * self.stride + self.span - self.left - length
        return self._conv(F.pad(x, (self.left, right)) if self.left or right else x, bias)

    def _conv(self, x: torch.Tensor, bias: bool) -> torch.Tensor:
        return self.conv(x) if bias else self.conv._conv_forward(x, self.conv.weight, None)


class CausalTransConv(nn.Module):
    """ConvTranspose1d with its last kernel - stride samples (the look-ahead) dropped, and its
    first `trim_left` (Qwen3-Omni drops kernel - stride there too). The result is a view."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, trim_left: int = 0):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel, stride=stride)
        self.trim_left, self.trim_right = trim_left, kernel - stride
        self.as_gemm = fused_vocoder() and kernel % stride == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_gemm and x.is_cuda:
            x = transposed_conv_as_gemm(x, self.conv.weight, self.conv.bias, self.conv.stride[0])
        else:
            x = self.conv(x)
        return x[..., self.trim_left: x.shape[-1] - self.trim_right]


def transposed_conv_as_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            stride: int) -> torch.Tensor:
    """conv_transpose1d(x, weight, bias, stride) for a kernel of `taps` strides: every input
    sample's kernel-long contribution is one GEMM row, [B, T, C_in] x [C_in, C_out * kernel];
    output block t (`stride` samples) is the sum of tap k of input t - k over the taps."""
    batch, _, length = x.shape
    c_in, c_out, kernel = weight.shape
    taps = kernel // stride
    cols = torch.matmul(x.transpose(1, 2), weight.reshape(c_in, c_out * kernel))
    cols = cols.view(batch, length, c_out, taps, stride).permute(0, 2, 3, 1, 4)  # [B, C_out, taps, T, stride]
    out = torch.empty(batch, c_out, length + taps - 1, stride, dtype=cols.dtype, device=cols.device)
    if bias is None:
        out.zero_()
    else:
        out.copy_(bias.view(1, -1, 1, 1))
    for tap in range(taps):
        out[:, :, tap: tap + length] += cols[:, :, tap]
    return out.view(batch, c_out, -1)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.act1.runs_fused(x):  # the convolutions add their bias (on the CPU inside the conv)
            return x + self.conv2(self.conv1(x, self.act1), self.act2)
        from vllm_omni.model_executor.layers import code2wav_ops

        h = self.conv1(x, self.act1, bias=False)
        h = self.conv2(self.act2(h, bias=self.conv1.conv.bias), bias=False)
        return code2wav_ops.bias_residual_add(x, h, self.conv2.conv.bias)


def run_layers(layers: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """x through layers in order; a SnakeBeta followed by a CausalConv runs as one call."""
    pending: SnakeBeta | None = None
    for layer in layers:
        if pending is not None:
            x = layer(x, pending) if isinstance(layer, CausalConv) else layer(pending(x))
            pending = None
        elif isinstance(layer, SnakeBeta):
            pending = layer
        else:
            x = layer(x)
    return x if pending is None else pending(x)
