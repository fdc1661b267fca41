"""What one TTS request hands the talker: the typed payload of its `additional_information`.

The input processor (multimodal/qwen3_tts_input.py) builds it in the caller's process; the talker reads it back
with `from_info` (msgpack-safe values and a few optional tensors: the reference audio, or a
stored voice's encodings). A request whose text streams in gets more text ids as `TEXT_IDS_KEY`
chunks (`append_request_inputs`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_PREFIX = "tts_"
REF_CODES_KEY = "ref_codes"  # talker export for voice cloning (ICL): [ref_frames, groups] long
CODES_KEY = "codec_codes"  # talker export: [frames, groups] long, the generated frames
TEXT_IDS_KEY = "streamed_text_ids"  # streamed text: the next token ids of the text (a list of ints)


@dataclass(frozen=True)
class TTSRequest:
    """text_ids: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` token ids.
    instruct_ids: `<|im_start|>user\\n{instructions}<|im_end|>\\n` ids, or None.
    speaker: a named voice (CustomVoice, lowercased), or None.
    language: "auto" or a key of the talker's codec_language_id.
    ref_audio: voice cloning (Base): reference waveform [N] float32 at 24 kHz.
    ref_speaker / ref_codes: voice cloning from a stored voice instead: the reference's speaker
      encoder row [H] and, for in-context cloning, its codes [F, G] long (what the talker
      computes from ref_audio; encoded once when the voice was created).
    ref_ids: `<|im_start|>assistant\\n{ref_text}<|im_end|>\\n` ids: in-context cloning (the
      reference's codes join the prompt); None clones from the speaker embedding alone.
    non_streaming: the whole text in the prompt (qwen-tts `non_streaming_mode`), else the text
      is fed one token per generated frame.
    text_complete: False when more text streams in (non_streaming must then be False): the
      text's end (tts_eos) is fed once the last chunk arrives.
    max_frames_per_token: streamed text only: when the talker has read all the text it has,
      it goes on with tts_pad rows until it has made this many frames per text token read,
      then waits for more (0: it waits at once, qwen-tts' layout exactly)."""

    text_ids: list[int]
    language: str = "auto"
    speaker: str | None = None
    instruct_ids: list[int] | None = None
    ref_audio: torch.Tensor | None = None
    ref_speaker: torch.Tensor | None = None
    ref_codes: torch.Tensor | None = None
    ref_ids: list[int] | None = None
    non_streaming: bool = True
    text_complete: bool = True
    max_frames_per_token: float = 0.0

    def __post_init__(self) -> None:
        if len(self.text_ids) < 9:
            raise ValueError("tts request: text_ids must hold the assistant turn around the text (>= 9 ids)")
        if self.ref_audio is not None and self.ref_speaker is not None:
            raise ValueError("tts request: a voice comes from ref_audio or from a stored voice, not both")
        if self.ref_ids is not None and self.ref_audio is None and self.ref_codes is None:
            raise ValueError("tts request: ref_ids (a reference transcript) needs ref_audio or ref_codes")
        if self.ref_audio is not None and (self.ref_audio.dim() != 1 or self.ref_audio.numel() == 0):
            raise ValueError("tts request: ref_audio must be a non-empty 1-D waveform")
        if self.ref_speaker is not None and self.ref_speaker.dim() != 1:
            raise ValueError("tts request: ref_speaker must be a 1-D row")
        if self.ref_codes is not None and (self.ref_speaker is None or self.ref_codes.dim() != 2
                                           or self.ref_ids is None or not self.ref_codes.shape[0]):
            raise ValueError("tts request: ref_codes must be [frames, groups], with ref_speaker and ref_ids")
        if not self.text_complete and self.non_streaming:
            raise ValueError("tts request: text that streams in needs non_streaming False")
        if self.max_frames_per_token < 0:
            raise ValueError("tts request: max_frames_per_token must be >= 0")

    @property
    def in_context(self) -> bool:
        return self.ref_ids is not None

    @property
    def clones(self) -> bool:
        return self.ref_audio is not None or self.ref_speaker is not None

    def to_info(self) -> dict[str, Any]:
        return {f"{_PREFIX}{k}": v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TTSRequest:
        fields = {k[len(_PREFIX):]: v for k, v in info.items() if k.startswith(_PREFIX)}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown or "text_ids" not in fields:
            raise ValueError(f"not a TTS request payload: keys {sorted(info)}")
        return cls(**fields)


def text_ids_chunk(info: Mapping[str, Any]) -> list[int]:
    """The token ids of one streamed text chunk (ValueError: not one)."""
    unknown = set(info) - {TEXT_IDS_KEY}
    ids = info.get(TEXT_IDS_KEY, [])
    if unknown or not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"a streamed TTS text chunk is {{{TEXT_IDS_KEY!r}: [token ids]}}, got keys {sorted(info)}")
    return ids
