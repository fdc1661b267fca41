"""Qwen2.5-Omni token2wav vocoder (transformers' BigVGAN): mel -> 24 kHz waveform, whole or
in overlapping windows.

BigVGAN is not causal: a sample depends on the mel frames up to `receptive_field` frames on
either side (34 for the released configuration, 0.34 s). A window that carries that many
frames of context on each side of the frames it emits gives exactly the samples of the whole
signal (overlap-save; no crossfade is needed, and none would be exact). Streaming uses it to
emit each chunk's audio, and the frames a window emits never depend on right padding, so
windows of different lengths share a call.

On CUDA each anti-aliased SnakeBeta (upsample 2x, SnakeBeta, low-pass and decimate: ~10 torch
kernels over the 2x signal, 3/4 of the vocoder's GPU time) runs as one kernel
(`fuse_activations`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_omni.model_executor.layers.activation import fused_vocoder
from vllm_omni.model_executor.models.codec_streaming import plan_padded_calls

# Padding a window by this many mel frames costs about one more vocoder call (its hundreds
# of small kernels): rows further apart in length get separate calls.
CALL_COST_FRAMES = 256


def hop_length(bigvgan) -> int:
    """Waveform samples per mel frame."""
    hop = 1
    for rate in bigvgan.config.upsample_rates:
        hop *= rate
    return hop


def tail_samples(bigvgan) -> int:
    """Samples a whole signal has past `frames * hop`: transformers pads each upsampling
    ConvTranspose1d by (kernel - stride) // 2 on both sides, so a layer whose kernel - stride is
    odd gives `stride` samples per input frame and one more, which the later layers upsample
    (every other layer keeps the length). Samples [f * hop, (f + 1) * hop) are still frame f's
    in any window, so the extra ones follow the last frame's: a stream's last chunk carries
    them. 0 for the released configuration."""
    tail = 0
    for (up,) in bigvgan.ups:
        stride = up.stride[0]
        extra = up.dilation[0] * (up.kernel_size[0] - 1) + up.output_padding[0] + 1 - stride - 2 * up.padding[0]
        tail = tail * stride + extra
    return tail


def check_vocoder(bigvgan) -> None:
    """Refuse, at load, a BigVGAN configuration that transformers builds but cannot run (every
    request would fail): an upsample kernel smaller than its stride (negative padding), or an
    even residual-block kernel (its convolutions shorten the signal; the residual sum fails)."""
    config = bigvgan.config
    for layer, (rate, kernel) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)):
        if kernel < rate:
            raise ValueError(f"token2wav: bigvgan_config upsample layer {layer} has kernel {kernel} < its rate {rate} "
                             f"(transformers pads it by (kernel - rate) // 2 < 0, which torch cannot run)")
    even = [kernel for kernel in config.resblock_kernel_sizes if kernel % 2 == 0]
    if even:
        raise ValueError(f"token2wav: bigvgan_config resblock_kernel_sizes {config.resblock_kernel_sizes} must be odd: "
                         f"with kernel {even[0]} transformers' residual blocks shorten the signal and cannot add it")


def vocode(bigvgan, mel: torch.Tensor) -> torch.Tensor:
    """transformers' BigVGAN on mel [B, mel_dim, T] -> [B, T * hop + tail_samples] (float32, CPU)."""
    wav = bigvgan(mel).reshape(mel.shape[0], -1).float()  # its forward squeezes and moves to CPU
    expected = mel.shape[2] * hop_length(bigvgan) + tail_samples(bigvgan)
    if wav.shape[1] != expected:  # the window arithmetic below relies on it
        raise RuntimeError(f"vocoder: {wav.shape[1]} samples for {mel.shape[2]} mel frames; expected {expected}")
    return wav


class _FusedAntiAliasedSnakeBeta(nn.Module):
    """transformers' `Qwen2_5OmniAntiAliasedActivation1d` around a SnakeBeta, with its children
    (so its parameter names), as `code2wav_ops.anti_aliased_snake_beta` on CUDA float32 input."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.act, self.upsample, self.downsample = original.act, original.upsample, original.downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float32 and x.stride(-1) == 1:
            from vllm_omni.model_executor.layers import code2wav_ops

            return code2wav_ops.anti_aliased_snake_beta(x, self.act.alpha, self.act.beta, self.upsample.filter.view(-1),
                                                    self.downsample.filter.view(-1))
        return self.downsample(self.act(self.upsample(x)))


def fuse_activations(bigvgan) -> None:
    """Replace every anti-aliased SnakeBeta of the kernel's geometry (ratio 2, 12-tap filters:
    how transformers' BigVGAN builds all of them) by `_FusedAntiAliasedSnakeBeta`.
    VLLM_OMNI_FUSED_VOCODER=0 keeps torch's ops (A/B runs)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAntiAliasedActivation1d, Qwen2_5OmniSnakeBeta,
    )

    if not fused_vocoder():
        return
    for name, module in list(bigvgan.named_modules()):
        up, down = getattr(module, "upsample", None), getattr(module, "downsample", None)
        if (isinstance(module, Qwen2_5OmniAntiAliasedActivation1d) and isinstance(module.act, Qwen2_5OmniSnakeBeta)
                and up.ratio == down.stride == 2 and up.kernel_size == down.kernel_size == 12):
            parent, _, attr = name.rpartition(".")
            setattr(bigvgan.get_submodule(parent), attr, _FusedAntiAliasedSnakeBeta(module))


def receptive_field(bigvgan) -> int:
    """Mel frames on either side that one frame's samples depend on: the span of samples one
    mel frame reaches, followed through every layer (intervals of positions per layer), in
    frames of `hop` samples. tests/models check it against perturbed inputs."""
    lo, hi = _conv(bigvgan.conv_pre, 0, 0)
    per_level = bigvgan.num_residual_blocks
    for level in range(bigvgan.num_upsample_layers):
        lo, hi = _conv_transpose(bigvgan.ups[level][0], lo, hi)
        spans = [_amp_block(block, lo, hi) for block in bigvgan.resblocks[level * per_level:(level + 1) * per_level]]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)  # parallel blocks, summed
    lo, hi = _conv(bigvgan.conv_post, *_activation(bigvgan.activation_post, lo, hi))
    hop = hop_length(bigvgan)
    return max(-(lo // hop), hi // hop)


def _conv(conv, lo: int, hi: int) -> tuple[int, int]:
    """Outputs of a stride-1 Conv1d that inputs [lo, hi] reach."""
    kernel, dilation, pad = conv.kernel_size[0], conv.dilation[0], conv.padding[0]
    return lo + pad - (kernel - 1) * dilation, hi + pad


def _conv_transpose(conv, lo: int, hi: int) -> tuple[int, int]:
    stride, kernel, pad = conv.stride[0], conv.kernel_size[0], conv.padding[0]
    return lo * stride - pad, hi * stride - pad + kernel - 1


def _activation(act, lo: int, hi: int) -> tuple[int, int]:
    """Anti-aliased activation: upsample (transposed filter), pointwise snake, downsample."""
    up, down = act.upsample, act.downsample
    lo, hi = (lo + up.pad) * up.ratio - up.pad_left, (hi + up.pad) * up.ratio + up.kernel_size - 1 - up.pad_left
    return -((down.kernel_size - 1 - down.pad_left - lo) // down.stride), (hi + down.pad_left) // down.stride


def _amp_block(block, lo: int, hi: int) -> tuple[int, int]:
    for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations[::2], block.activations[1::2]):
        lo, hi = _conv(conv2, *_activation(act2, *_conv(conv1, *_activation(act1, lo, hi))))  # wider than the residual
    return lo, hi


@dataclass(frozen=True)
class VocoderWindow:
    """Mel [mel_dim, n] to vocode; samples of frames [emit_from, emit_to) of it are kept."""

    mel: torch.Tensor
    emit_from: int
    emit_to: int
    # The window ends where the request ends: it must not be padded, and its samples run on
    # past frame emit_to's by the vocoder's `tail_samples`.
    exact_end: bool


def vocode_windows(bigvgan, windows: list[VocoderWindow], device: torch.device) -> list[torch.Tensor]:
    """The kept samples of each window, float32 on the CPU. Windows that end inside their
    request are right-padded into shared calls (their kept frames are >= receptive field away
    from the end, out of the padding's reach); a window ending at its request's end runs at
    its own length, with others of that same length only."""
    hop, tail, out = hop_length(bigvgan), tail_samples(bigvgan), [torch.zeros(0)] * len(windows)
    padded = [i for i, w in enumerate(windows) if not w.exact_end and w.emit_to > w.emit_from]
    exact = [i for i, w in enumerate(windows) if w.exact_end and w.emit_to > w.emit_from]
    lengths = [w.mel.shape[1] for w in windows]
    calls = [[padded[j] for j in call] for call in plan_padded_calls([lengths[i] for i in padded], CALL_COST_FRAMES)]
    calls += [[i for i in exact if lengths[i] == n] for n in sorted({lengths[i] for i in exact})]
    for rows in calls:
        longest = max(lengths[i] for i in rows)
        mel = torch.zeros(len(rows), windows[rows[0]].mel.shape[0], longest)
        for slot, i in enumerate(rows):
            mel[slot, :, : lengths[i]] = windows[i].mel
        wav = vocode(bigvgan, mel.to(device))
        for slot, i in enumerate(rows):
            end = windows[i].emit_to * hop + (tail if windows[i].exact_end else 0)
            out[i] = wav[slot, windows[i].emit_from * hop: end].clone()
    return out
