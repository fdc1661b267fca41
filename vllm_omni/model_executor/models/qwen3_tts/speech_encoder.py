"""The 12 Hz speech tokenizer's encoder: 24 kHz reference audio -> RVQ codes [frames, groups].

Voice cloning (Base) feeds the reference audio's codes to the talker. The encoder is a Mimi
model without its decoding half; we wrap transformers' `MimiModel` (the module qwen-tts
subclasses), loaded from the checkpoint's `speech_tokenizer/model.safetensors` `encoder.*`
tensors. Those carry transformers 4.x names (as released); transformers 5.24 nests the SEANet,
its transformer and the downsampling conv one level deeper, so names are mapped on load
(either layout works: the map is built from the module's own names).

`encode_padded` gives the codes of a reference from a longer buffer that holds it, equal to
those of the reference alone, so that one CUDA graph per buffer length serves every reference
(reference_graphs.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

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

    def supports_padding(self) -> bool:
        """Whether `encode_padded` equals `encode`: each convolution pads its right end with zeros or
        with its last value (Qwen3-TTS' tokenizer: zeros, and the downsampling conv replicates)."""
        return all(conv.pad_mode in _PAST_THE_END for conv in self._encoding_convs())

    @torch.inference_mode()
    def encode_padded(self, audio: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """audio [B] (B a multiple of samples_per_frame), of which the first `length` samples (a 0-dim
        long tensor on the device) are the reference -> codes [B / samples_per_frame, Q], whose first
        ceil(length / samples_per_frame) rows are `encode(audio[:length])`.

        Why it is exact: the encoder pads each convolution's input on the right up to a whole number
        of strides (zeros, or the last value); here every convolution's input past the real length
        the unpadded encode would give it is overwritten with that padding, so each real output sees
        the same values. The transformer is causal, and each code depends on its own frame only."""
        _conv_geometry_on_host(self.mimi)
        with self._padded_past(length):
            codes = self.mimi.encode(audio[None, None], num_quantizers=self.valid_quantizers,
                                     return_dict=True).audio_codes
        return codes[0].T

    def _encoding_convs(self) -> list[nn.Module]:
        return [m for name, m in self.mimi.named_modules()
                if type(m).__name__ == "MimiConv1d" and to_released_name(name + ".weight") is not None]

    @contextlib.contextmanager
    def _padded_past(self, length: torch.Tensor) -> Iterator[None]:
        """Hooks on the encoding half's convolutions, which run one after another: each pads its
        input past the current real length, then advances that length to its output's (transformers'
        MimiConv1d._get_output_length, as arithmetic on the device)."""
        real = length.clone()

        def pad_past(conv, args):
            x = args[0]
            return (_PAST_THE_END[conv.pad_mode](x, torch.arange(x.shape[-1], device=x.device), real), *args[1:])

        def advance(conv, args, output):
            kernel, stride, total = int(conv.kernel_size), int(conv.stride), int(conv.padding_total)
            real.copy_(torch.div(real - kernel + total + stride - 1, stride, rounding_mode="floor") + 1)

        handles = []
        for conv in self._encoding_convs():
            handles += [conv.register_forward_pre_hook(pad_past), conv.register_forward_hook(advance)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


# pad mode -> (x [..., T], positions [T], real length) -> x with every position past the real end
# holding what that mode pads with
_PAST_THE_END = {
    "constant": lambda x, t, real: torch.where(t < real, x, 0),
    "replicate": lambda x, t, real: x.index_select(-1, torch.minimum(t, real - 1)),
}


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
