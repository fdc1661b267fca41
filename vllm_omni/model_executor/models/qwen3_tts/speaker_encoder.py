"""Base (voice cloning) checkpoints' speaker encoder: 24 kHz audio -> one talker input row.

Our implementation of qwen-tts' `Qwen3TTSSpeakerEncoder` (ECAPA-TDNN; parameter names match the
checkpoint's `speaker_encoder.` tensors) and of its `mel_spectrogram` (n_fft 1024, hop 256,
128 slaney mels up to 12 kHz, log-compressed), which feeds it.

The encoder also runs on a mel padded past its real length (`ValidFrames`), with the result of
the unpadded mel: every convolution pads by reflection at the real end, the means and the
attention's softmax see only real frames. So one CUDA graph per padded length serves every
reference (reference_graphs.py).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.device_copy import to_device_nowait

SAMPLE_RATE = 24000
N_FFT, HOP, NUM_MELS, F_MAX = 1024, 256, 128, 12000


@functools.lru_cache(maxsize=1)
def _mel_basis() -> torch.Tensor:
    from transformers.audio_utils import mel_filter_bank

    # librosa.filters.mel's defaults (slaney scale and norm), which qwen-tts uses.
    bank = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=NUM_MELS, min_frequency=0.0,
                           max_frequency=F_MAX, sampling_rate=SAMPLE_RATE, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(np.ascontiguousarray(bank.T)).float()  # [mels, freqs]


def mel_spectrogram(audio: torch.Tensor) -> torch.Tensor:
    """audio [N] float at 24 kHz -> log mel [frames, 128]."""
    pad = (N_FFT - HOP) // 2
    y = F.pad(audio[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=N_FFT, window=torch.hann_window(N_FFT), center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = _mel_basis() @ magnitude
    return torch.log(mel.clamp(min=1e-5))[0].T


class ValidFrames:
    """The first `length` (a 0-dim long tensor, on the device) of a padded mel's frames are real.

    `reflected(x)` makes x's frames after the real end what reflect padding at that end would
    put there (frame `length + k` is frame `length - 2 - k`: torch's "reflect"), so that a "same"
    convolution gives every real frame what it gives it on the unpadded input; `mean(x)` and
    `mask` keep statistics to the real frames. Frames past the real end hold anything."""

    def __init__(self, frames: int, length: torch.Tensor):
        t = torch.arange(frames, device=length.device)
        self.mask = t < length  # [T]
        self.count = length.to(torch.float32)
        self.reflect_index = torch.where(self.mask, t, (2 * length - 2 - t).clamp(min=0))

    def reflected(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(2, self.reflect_index)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C, 1], over the real frames."""
        return (torch.where(self.mask, x, 0).sum(2, keepdim=True, dtype=torch.float32) / self.count).to(x.dtype)


def _conv(in_ch: int, out_ch: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNNBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _conv(in_ch, out_ch, kernel, dilation)

    def forward(self, x: torch.Tensor, valid: ValidFrames | None = None) -> torch.Tensor:
        if valid is not None and self.conv.kernel_size[0] > 1:
            x = valid.reflected(x)
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNNBlock(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor, valid: ValidFrames | None = None) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1], valid))
        return torch.cat(out, dim=1)


class SEBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor, valid: ValidFrames | None = None) -> torch.Tensor:
        mean = x.mean(dim=2, keepdim=True) if valid is None else valid.mean(x)
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(mean))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNNBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(out_ch, scale, kernel, dilation)
        self.tdnn2 = TDNNBlock(out_ch, out_ch, 1, 1)
        self.se_block = SEBlock(out_ch, se_channels)

    def forward(self, x: torch.Tensor, valid: ValidFrames | None = None) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x), valid)), valid)


class AttentiveStatsPool(nn.Module):
    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    @staticmethod
    def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
        return mean, std

    def forward(self, x: torch.Tensor, valid: ValidFrames | None = None) -> torch.Tensor:
        if valid is None:
            uniform = torch.full_like(x[:, :1], 1.0 / x.shape[-1])
        else:  # padded frames weigh 0 (where, not a product: they may hold anything)
            x = torch.where(valid.mask, x, 0)
            uniform = torch.where(valid.mask, 1.0 / valid.count, 0).to(x.dtype).expand_as(x[:, :1])
        mean, std = self._stats(x, uniform)
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context, valid)))
        if valid is not None:
            scores = scores.masked_fill(~valid.mask, float("-inf"))
        mean, std = self._stats(x, F.softmax(scores, dim=2))
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """mel [B, frames, mel_dim] -> speaker embedding [B, enc_dim] (= the talker's width)."""

    def __init__(self, config):
        super().__init__()
        ch, k, d = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList([TDNNBlock(config.mel_dim, ch[0], k[0], d[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i - 1], ch[i], config.enc_res2net_scale, config.enc_se_channels,
                                              k[i], d[i]))
        self.mfa = TDNNBlock(ch[-1], ch[-1], k[-1], d[-1])
        self.asp = AttentiveStatsPool(ch[-1], config.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, config.enc_dim, 1)

    @property
    def max_reflect_padding(self) -> int:
        """The widest reflection of its convolutions: a mel needs more frames than this."""
        spans = [conv.dilation[0] * (conv.kernel_size[0] - 1) for conv in self.modules() if isinstance(conv, nn.Conv1d)]
        return max(span - span // 2 for span in spans)  # "same" puts the odd frame on the right

    def forward(self, mel: torch.Tensor, length: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, T, mel_dim]; `length` (0-dim long, on the device): only the first `length`
        frames are real (every row's), the result is that of mel[:, :length]."""
        x = mel.transpose(1, 2)
        valid = None if length is None else ValidFrames(x.shape[-1], length)
        outputs = []
        for block in self.blocks:
            x = block(x, valid)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1), valid)
        return self.fc(self.asp(x, valid))[..., 0]

    @torch.inference_mode()
    def embed(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [N] at 24 kHz -> [enc_dim]"""
        weight = self.fc.weight
        mel = to_device_nowait(mel_spectrogram(audio.float().cpu()), weight.device).to(weight.dtype)
        return self(mel[None])[0]
