"""`ClonedVoice`: a voice cloned from a reference recording, encoded once and kept for reuse.

What a codec-LM text-to-speech model computes from a reference (Qwen3-TTS Base: its speaker
encoder's row and its speech tokenizer's codes of the reference, qwen3_tts/voice_encoder.py),
held apart from any family so that the server's voices store (entrypoints/openai/voices_store.py)
keeps and reloads it without importing a model family.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClonedVoice:
    """speaker: [H] float32, the speaker encoder's row; codes: [F, G] long, the reference's
    codes (None: the voice clones from the speaker row alone, qwen-tts' x_vector_only_mode);
    ref_text: the reference's transcript (with codes)."""

    speaker: torch.Tensor
    codes: torch.Tensor | None = None
    ref_text: str | None = None

    def __post_init__(self) -> None:
        if self.speaker.dim() != 1 or not self.speaker.is_floating_point():
            raise ValueError("a cloned voice's speaker row must be a 1-D float tensor")
        if (self.codes is None) != (self.ref_text is None):
            raise ValueError("a cloned voice has codes and their transcript, or neither")
        if self.codes is not None and (self.codes.dim() != 2 or self.codes.dtype != torch.long):
            raise ValueError("a cloned voice's codes must be [frames, groups] int64")

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"speaker": self.speaker.contiguous()}
        if self.codes is not None:
            out["codes"] = self.codes.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], ref_text: str | None) -> ClonedVoice:
        unknown = set(tensors) - {"speaker", "codes"}
        if unknown or "speaker" not in tensors:
            raise ValueError(f"not a cloned voice: tensors {sorted(tensors)}")
        return cls(tensors["speaker"], tensors.get("codes"), ref_text)
