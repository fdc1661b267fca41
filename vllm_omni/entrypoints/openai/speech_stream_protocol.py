"""Client events of the speech socket (/v1/audio/speech/stream) and where its text is cut.

OpenAI's realtime conventions (JSON events with a `type`, unknown fields refused, `error`
events), with the text-in events of realtime TTS APIs:

    {"type": "session.update", "session": {"voice": "vivian", "language": "English", ...}}
    {"type": "input_text.append", "text": "Hello there. How"}
    {"type": "input_text.flush"}     the text so far is spoken; the utterance ends
    {"type": "input_text.end"}       flush, then the server closes the socket after the audio

`PhraseCutter` finds where the talker may start on buffered text: after sentence or clause
punctuation (`phrase_ends`: "clause", the default; "sentence": . ! ? … only) followed by a
space (ASCII) or at once (CJK), at a line break, or, past
`max_phrase_chars` without one, at the last space. The cut keeps the space with the next
phrase, where a byte-level BPE keeps it, so phrases tokenize as the whole text does.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError, parse_client_event

MAX_PHRASE_CHARS = 200
PhraseEnds = Literal["clause", "sentence"]  # where a phrase may end: any punctuation, or a sentence's end


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingIn(_Strict):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)  # codec frames per utterance


class StreamSessionIn(_Strict):
    model: str | None = None
    voice: str | None = None
    response_format: Literal["pcm"] | None = None  # 16-bit little-endian mono at 24 kHz
    instructions: str | None = None
    language: str | None = None
    # While it waits for text, the talker may go on speaking what it read until it made this many
    # frames per text token (0: it waits at once; text_feed.py).
    max_frames_per_token: float | None = Field(None, ge=0.0, le=100.0)
    max_phrase_chars: int | None = Field(None, ge=8, le=2000)
    phrase_ends: PhraseEnds | None = None
    sampling: SamplingIn | None = None


class SessionUpdate(_Strict):
    type: Literal["session.update"]
    event_id: str | None = None
    session: StreamSessionIn


class TextAppend(_Strict):
    type: Literal["input_text.append"]
    event_id: str | None = None
    text: str


class TextFlush(_Strict):
    type: Literal["input_text.flush"]
    event_id: str | None = None


class TextEnd(_Strict):
    type: Literal["input_text.end"]
    event_id: str | None = None


StreamEvent = Union[SessionUpdate, TextAppend, TextFlush, TextEnd]
EVENT_TYPES: dict[str, type[BaseModel]] = {"session.update": SessionUpdate, "input_text.append": TextAppend,
                                           "input_text.flush": TextFlush, "input_text.end": TextEnd}


def parse_event(payload: str | bytes) -> StreamEvent:
    return parse_client_event(payload, EVENT_TYPES)


# ASCII sentence / clause punctuation ends a phrase when a space follows (not "3.14", "e.g.x");
# CJK punctuation at once (no spaces there).
_ASCII_END = re.compile(r"[.!?;:…,]+[\"')\]]*(?=\s)|\n")
_CJK_END = re.compile(r"[。！？；：，、]+[」』）]*")
_ASCII_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*(?=\s)|\n")
_CJK_SENTENCE_END = re.compile(r"[。！？]+[」』）]*")
_ENDS = {"clause": (_ASCII_END, _CJK_END), "sentence": (_ASCII_SENTENCE_END, _CJK_SENTENCE_END)}


class PhraseCutter:
    def __init__(self, max_phrase_chars: int = MAX_PHRASE_CHARS, phrase_ends: PhraseEnds = "clause") -> None:
        self.max_phrase_chars = max_phrase_chars
        self.ends = _ENDS[phrase_ends]

    def cut(self, text: str) -> int:
        """The end of the longest leading part of `text` that ends at a phrase boundary (0: none
        yet, wait for more text)."""
        ends = [m.end() for pattern in self.ends for m in pattern.finditer(text)]
        end = max(ends, default=0)
        if end == 0 and len(text) > self.max_phrase_chars:
            space = text.rfind(" ", 0, self.max_phrase_chars)
            end = space if space > 0 else self.max_phrase_chars
        return end


def check_session(session: StreamSessionIn, served: list[str]) -> None:
    if session.model is not None and session.model not in served:
        raise ProtocolError(f"this server serves {served}, not {session.model!r}", code="model_not_found",
                            param="session.model")


def sampling_overrides(sampling: SamplingIn | None) -> dict[str, Any] | None:
    if sampling is None:
        return None
    return {k: v for k, v in sampling.model_dump().items() if v is not None} or None
