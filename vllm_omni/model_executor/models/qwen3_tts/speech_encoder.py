"""The 12 Hz speech tokenizer's encoder: 24 kHz reference audio -> RVQ codes [frames, groups].

Voice cloning (Base) feeds the reference audio's codes to the talker. The encoder is a Mimi
model without its decoding half; we wrap transformers' `MimiModel` (the module qwen-tts
subclasses), loaded from the checkpoint's `speech_tokenizer/model.safetensors` `encoder.*`
tensors. Those carry transformers 4.x names (as released); transformers 5.24 nests the SEANet,
its transformer and the downsampling conv one level deeper, so names are mapped on load
(either layout works: the map is built from the module's own names).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vllm_omni.model_executor.device_copy import to_device_nowait

ENCODER_PREFIX = "encoder."
# transformers 5 MimiModel name prefix -> released (transformers 4) prefix; other names of the
# encoding half are the same in both layouts.
_NEW_TO_RELEASED = (("encoder.encoder_transformer.", "encoder_transformer."), ("encoder.downsample.", "downsample."),
                    ("encoder.encoder_seanet.", "encoder."))
_DECODING_HALF = ("decoder.", "upsample.", "decoder_transformer.")


def to_released_name(name: str) -> str | None:
    """A MimiModel parameter name (either transformers layout) -> its name in a released
    checkpoint; None for the decoding half, which the speech tokenizer does not keep."""
    for new, old in _NEW_TO_RELEASED:
        if name.startswith(new):
            return old + name[len(new):]
    return None if name.startswith(_DECODING_HALF) else name


class SpeechEncoder(nn.Module):
    def __init__(self, config: Mapping, valid_quantizers: int, samples_per_frame: int):
        super().__init__()
        from transformers import MimiConfig, MimiModel

        self.mimi = MimiModel(MimiConfig(**config))
        self.valid_quantizers = valid_quantizers
        self.samples_per_frame = samples_per_frame

    def load_released(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load the checkpoint's `encoder.*` tensors (prefix stripped); strict for the encoding half."""
        ours = {to_released_name(name): name for name in self.mimi.state_dict()}
        ours.pop(None, None)
        unexpected = sorted(set(tensors) - set(ours))
        missing = sorted(set(ours) - set(tensors))
        if missing or unexpected:
            raise ValueError(f"speech tokenizer encoder: missing {missing[:8]}, unexpected {unexpected[:8]}")
        self.mimi.load_state_dict({ours[name]: tensor for name, tensor in tensors.items()}, strict=False)

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [N] float at 24 kHz -> codes [ceil(N / samples_per_frame), valid_quantizers] long,
        on the encoder's device."""
        weight = next(self.mimi.parameters())
        _conv_geometry_on_host(self.mimi)
        audio = to_device_nowait(audio, weight.device).to(weight.dtype)
        # The codes are residual: the first valid_quantizers do not depend on the rest, skipped.
        codes = self.mimi.encode(audio[None, None], num_quantizers=self.valid_quantizers, return_dict=True).audio_codes
        frames = -(-audio.shape[0] // self.samples_per_frame)
        return codes[0, :, :frames].T


_GEOMETRY = ("stride", "kernel_size", "padding_total", "padding_left", "padding_right")


def _conv_geometry_on_host(mimi: nn.Module) -> None:
    """transformers' MimiConv1d keeps its stride, kernel size and paddings as 0-dim tensors that
    move with the module; each convolution then computes its padding on the GPU and reads it back
    (~30 waits per encode, H200). On the host the same arithmetic waits for nothing."""
    for module in mimi.modules():
        for name in _GEOMETRY:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_cpu:
                setattr(module, name, value.cpu())
