"""The 12 Hz speech tokenizer's encoder: 24 kHz reference audio -> RVQ codes [frames, groups].

Voice cloning (Base) feeds the reference audio's codes to the talker. The encoder is a Mimi
model without its decoding half; we wrap transformers' `MimiModel` (the module qwen-tts
subclasses), loaded from the checkpoint's `speech_tokenizer/model.safetensors` `encoder.*`
tensors. Those carry transformers 4.x names (as released); transformers 5 nests the SEANet,
its transformer and the downsampling conv one level deeper, so names are mapped on load.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

ENCODER_PREFIX = "encoder."
# released (transformers 4) name prefix -> transformers 5 MimiModel name prefix
_RENAMES = (("encoder_transformer.", "encoder.encoder_transformer."), ("downsample.", "encoder.downsample."),
            ("encoder.", "encoder.encoder_seanet."), ("quantizer.", "quantizer."))
_DECODING_HALF = ("decoder.", "upsample.", "decoder_transformer.")


def to_transformers_name(released: str) -> str | None:
    """`encoder.layers.0.conv.weight` (released) -> `encoder.encoder_seanet.layers.0.conv.weight`."""
    for old, new in _RENAMES:
        if released.startswith(old):
            return new + released[len(old):]
    return None


def to_released_name(name: str) -> str | None:
    """Inverse of `to_transformers_name`; None for the decoding half, which is not released."""
    for old, new in _RENAMES:
        if name.startswith(new):
            return old + name[len(new):]
    return None


class SpeechEncoder(nn.Module):
    def __init__(self, config: Mapping, valid_quantizers: int, samples_per_frame: int):
        super().__init__()
        from transformers import MimiConfig, MimiModel

        self.mimi = MimiModel(MimiConfig(**config))
        self.valid_quantizers = valid_quantizers
        self.samples_per_frame = samples_per_frame

    def load_released(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load the checkpoint's `encoder.*` tensors (prefix stripped); strict for the encoding half."""
        state = {}
        for name, tensor in tensors.items():
            mapped = to_transformers_name(name)
            if mapped is None:
                raise ValueError(f"speech tokenizer encoder tensor {name!r} has no place in Mimi")
            state[mapped] = tensor
        missing, unexpected = self.mimi.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.split(".", 1)[-1].startswith(_DECODING_HALF)
                   and not m.startswith(_DECODING_HALF)]
        if missing or unexpected:
            raise ValueError(f"speech tokenizer encoder: missing {missing}, unexpected {unexpected}")

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [N] float at 24 kHz -> codes [ceil(N / samples_per_frame), valid_quantizers] long."""
        weight = next(self.mimi.parameters())
        codes = self.mimi.encode(audio.to(weight.device, weight.dtype)[None, None], return_dict=True).audio_codes
        frames = -(-audio.shape[0] // self.samples_per_frame)
        return codes[0, : self.valid_quantizers, :frames].T.cpu()
