"""Activations: the gated one of the decoder LMs, SnakeBeta of the codec vocoders."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

import vllm_omni.envs as envs


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


def fused_vocoder() -> bool:
    return envs.FUSED_VOCODER.get()  # off: the vocoders' layers as torch's ops (A/B runs)


class SnakeBeta(nn.Module):
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9), per channel of [B, C, T] (the vocoders of
    Qwen3-TTS and Qwen3-Omni; the parameter names and math of transformers' SnakeBeta).

    Between the vocoder's convolutions it is memory-bound: torch runs it as five kernels, each
    reading and writing the whole activation; on CUDA one Triton pass gives the same bits.
    There `left_pad` zeros before the output (the next causal conv's padding) and a `bias`
    added first (the previous conv's, which cuDNN would add in a pass of its own) come free."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.fused = fused_vocoder()

    def forward(self, x: torch.Tensor, left_pad: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.runs_fused(x):
            from vllm_omni.model_executor.layers import code2wav_ops

            return code2wav_ops.snake_beta(x, self.alpha, self.beta, left_pad, bias)
        if bias is not None:
            x = x + bias[None, :, None]
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        out = x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
        return F.pad(out, (left_pad, 0)) if left_pad else out

    def runs_fused(self, x: torch.Tensor) -> bool:
        return self.fused and x.is_cuda and x.dim() == 3 and x.stride(-1) == 1 and x.dtype == self.alpha.dtype
