"""What one TTS request hands the talker: the typed payload of its `additional_information`.

The input processor (multimodal/qwen3_tts_input.py) builds it in the caller's process; the talker reads it back
with `from_info` (msgpack-safe values and one optional tensor, the reference audio).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_PREFIX = "tts_"
REF_CODES_KEY = "ref_codes"  # talker export for voice cloning (ICL): [ref_frames, groups] long
CODES_KEY = "codec_codes"  # talker export: [frames, groups] long, the generated frames


@dataclass(frozen=True)
class TTSRequest:
    """text_ids: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` token ids.
    instruct_ids: `<|im_start|>user\\n{instructions}<|im_end|>\\n` ids, or None.
    speaker: a named voice (CustomVoice, lowercased), or None.
    language: "auto" or a key of the talker's codec_language_id.
    ref_audio: voice cloning (Base): reference waveform [N] float32 at 24 kHz.
    ref_ids: `<|im_start|>assistant\\n{ref_text}<|im_end|>\\n` ids: in-context cloning (the
      reference's codes join the prompt); None clones from the speaker embedding alone.
    non_streaming: the whole text in the prompt (qwen-tts `non_streaming_mode`), else the text
      is fed one token per generated frame."""

    text_ids: list[int]
    language: str = "auto"
    speaker: str | None = None
    instruct_ids: list[int] | None = None
    ref_audio: torch.Tensor | None = None
    ref_ids: list[int] | None = None
    non_streaming: bool = True

    def __post_init__(self) -> None:
        if len(self.text_ids) < 9:
            raise ValueError("tts request: text_ids must hold the assistant turn around the text (>= 9 ids)")
        if self.ref_ids is not None and self.ref_audio is None:
            raise ValueError("tts request: ref_ids (a reference transcript) needs ref_audio")
        if self.ref_audio is not None and (self.ref_audio.dim() != 1 or self.ref_audio.numel() == 0):
            raise ValueError("tts request: ref_audio must be a non-empty 1-D waveform")

    @property
    def in_context(self) -> bool:
        return self.ref_ids is not None

    def to_info(self) -> dict[str, Any]:
        info = {f"{_PREFIX}{k}": v for k, v in self.__dict__.items() if v is not None}
        return info

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TTSRequest:
        fields = {k[len(_PREFIX):]: v for k, v in info.items() if k.startswith(_PREFIX)}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown or "text_ids" not in fields:
            raise ValueError(f"not a TTS request payload: keys {sorted(info)}")
        return cls(**fields)
