"""Upstream vLLM-Omni's dialect of the speech socket, translated at the edge onto our session.

A client whose first message is `session.config` speaks upstream's protocol for the whole
session (docs/compatibility.md); the session underneath is the same SpeechStreamSession, with
the same caps, limits, backpressure and Origin rules:

    client                                      ours
    {"type": "session.config", <flat fields>}   session.update (model, voice, language,
                                                instructions, max_new_tokens, seed, split_granularity);
                                                ref_audio + ref_text: the session's cloned voice
    {"type": "input.text", "text": "..."}       input_text.append
    {"type": "input.done"}                      input_text.flush (the socket stays open)
    {"type": "session.close"}                   input_text.end (speaks what was sent, then closes)

    server (per utterance of ours: one upstream "sentence")
    {"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format", ...}
    <binary frames>  stream_audio=true: PCM16 (or a streamed WAV) as it is made;
                     false (upstream's default): the utterance's whole file in `format`
    {"type": "audio.done", "utterance_index", "sentence_index"}
    {"type": "session.done", "utterance_index", "total_sentences"}   after each input.done
    {"type": "error", "message", "code", "param"}

`utterance_index` counts input.done flushes, `sentence_index` the utterances inside one.
Our `session.created` (sent on accept, before the dialect is known) still comes first.
"""
from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError, parse_client_event
from vllm_omni.entrypoints.openai.speech_audio import encode_speech, wav_stream_header
from vllm_omni.entrypoints.openai.speech_stream_protocol import (
    SamplingIn, SessionUpdate, StreamSessionIn, TextAppend, TextEnd, TextFlush,
)

SAMPLE_RATE = 24000
FIRST_TYPE = "session.config"  # a first message of this type picks this dialect
_FLUSHED = "upstream.flushed"  # internal marker, queued behind the events an input.done caused

# Upstream fields this server refuses by name, with what to do instead.
REFUSED = {
    "speaker_embedding": "upload the voice's audio (POST /v1/audio/voices) and name it in 'voice'",
    "references": "upload the voice (POST /v1/audio/voices) and name it in 'voice'",
    "initial_codec_chunk_frames": "the stage config sets the first chunk's size",
    "non_streaming_mode": "the socket always streams its text into the talker",
    "word_timestamps": "each utterance's text span is in our dialect's speech.audio.delta events",
}


class UpstreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["session.config"]
    model: str | None = None
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    response_format: Literal["wav", "pcm", "flac", "mp3", "aac", "opus"] = "wav"
    stream_audio: bool = False
    speed: float = Field(1.0, ge=1.0, le=1.0)  # the socket's audio is not re-timed
    max_new_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    split_granularity: Literal["sentence", "clause"] | None = None
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None  # the served checkpoint's, or refused
    # A Base checkpoint's voice for this session: encoded once here, as a stored voice is
    ref_audio: str | None = None  # URL, data URL or base64 (through the media gate)
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input.text"]
    text: str


class InputDone(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input.done"]


class SessionClose(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["session.close"]


_TYPES: dict[str, type[BaseModel]] = {"session.config": UpstreamConfig, "input.text": InputText,
                                      "input.done": InputDone, "session.close": SessionClose}


def picks_upstream(payload: str | bytes) -> bool:
    """The first message says which dialect the session speaks."""
    try:
        data = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and data.get("type") == FIRST_TYPE


def parse(payload: str | bytes) -> BaseModel:
    try:
        data = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None  # parse_client_event says why
    if isinstance(data, dict) and data.get("type") == FIRST_TYPE:
        refused = sorted(set(data) & set(REFUSED))
        if refused:
            raise ProtocolError(f"session.config field {refused[0]!r} is not supported here: {REFUSED[refused[0]]}",
                                code="unsupported_parameter", param=refused[0])
    return parse_client_event(payload, _TYPES)


class UpstreamDialect:
    """Client messages -> session events; session events -> upstream's frames (in the sender)."""

    def __init__(self, session: Any, send: Any) -> None:
        self.session, self.send = session, send
        # (first utterance index, response_format, stream_audio): a config applies from the next
        # utterance the session starts; audio under way keeps the format it started with.
        self.formats: list[tuple[int, str, bool]] = [(0, "wav", False)]
        self.seen = 0  # utterances whose events came out (they come out in order)
        self.response_format, self.stream_audio = "wav", False
        self.utterance_index = self.sentence_index = 0
        self.flushes: list[int] = []  # text offsets of the input.done flushes not yet answered
        self.spoken_end = 0  # the end of the text the finished utterances covered
        self.current: str | None = None  # the utterance whose audio is going out
        self.pcm: list[bytes] = []  # its audio, while it is not streamed

    # ------------------------------------------------------------------ client -> session
    async def receive(self, payload: str | bytes) -> None:
        message = parse(payload)
        if isinstance(message, UpstreamConfig):
            update = self._update(message)
            before = self.session.reference  # each config names the session's whole voice
            self.session.reference = await self._clone(message) if message.ref_audio is not None else None
            try:
                await self.session.handle(update)
            except BaseException:
                self.session.reference = before
                raise
            self.formats.append((self.session.started, message.response_format, message.stream_audio))
        elif isinstance(message, InputText):
            await self.session.handle(TextAppend(type="input_text.append", text=message.text))
        elif isinstance(message, InputDone):
            offset = len(self.session.text)
            await self.session.handle(TextFlush(type="input_text.flush"))
            await self.send({"type": _FLUSHED, "offset": offset})
        else:
            await self.session.handle(TextEnd(type="input_text.end"))

    def _update(self, c: UpstreamConfig) -> SessionUpdate:
        served = self.session.speech.info.task_type
        if c.task_type is not None and c.task_type != served:
            raise ProtocolError(f"task_type {c.task_type!r}: this server's checkpoint is a {served} checkpoint",
                                param="task_type")
        if c.stream_audio and c.response_format not in ("pcm", "wav"):
            raise ProtocolError(f"stream_audio=true streams pcm or wav, not {c.response_format!r}",
                                param="response_format")
        sampling = None
        if c.max_new_tokens is not None or c.seed is not None:
            sampling = SamplingIn(max_tokens=c.max_new_tokens, seed=c.seed)
        # Upstream speaks what it was given as written: the talker waits for text rather than
        # filling with pads, so an utterance's speech is that of its whole text at once.
        update = SessionUpdate(type="session.update", session=StreamSessionIn(
            model=c.model, voice=c.voice, language=c.language, instructions=c.instructions, sampling=sampling,
            phrase_ends=c.split_granularity, max_frames_per_token=0.0))
        return update

    async def _clone(self, c: UpstreamConfig) -> Any:
        """The session's voice from an inline reference, as POST /v1/audio/voices makes one."""
        voices = self.session.speech.voices
        if not voices.clones:
            raise ProtocolError(f"ref_audio: a {voices.task_type} checkpoint clones no voices", param="ref_audio")
        if c.x_vector_only_mode and c.ref_text is not None:
            raise ProtocolError("an x-vector-only voice has no transcript: give no ref_text", param="ref_text")
        if not c.x_vector_only_mode and not (c.ref_text or "").strip():
            raise ProtocolError("ref_text (the transcript of ref_audio) is required, or x_vector_only_mode",
                                param="ref_text")
        try:
            data = await self.session.speech.reference_audio(c.ref_audio)
            data = data.read_bytes() if hasattr(data, "read_bytes") else data
            cloned, _ = await voices.clone(data, None if c.x_vector_only_mode else c.ref_text, "ref_audio")
        except APIError as e:
            raise ProtocolError(e.message, param=e.param or "ref_audio") from None
        return cloned

    # ------------------------------------------------------------------ session -> client
    async def frames(self, event: dict[str, Any]) -> list[str | bytes]:
        kind = event["type"]
        if kind == "speech.audio.delta":
            return await self._delta(event)
        if kind == "speech.audio.done":
            return await self._done(event)
        if kind == _FLUSHED:
            self.flushes.append(event["offset"])
            return self._answered_flushes()
        if kind == "error":
            err = event["error"]
            return [_json({"type": "error", "message": err["message"], "code": err["code"], "param": err["param"]})]
        if kind == "session.created":  # sent on accept, before the client's first message chose this dialect
            return [_json(event)]
        return []  # session.updated: upstream answers a config with nothing

    async def _delta(self, event: dict[str, Any]) -> list[str | bytes]:
        pcm = base64.b64decode(event["audio"])
        out: list[str | bytes] = []
        if event["utterance_id"] != self.current:
            self._next(event["utterance_id"])
            if self.stream_audio:
                text = self.session.text[event["text_start"]:self.session.handed]
                out.append(self._start(text))
                if self.response_format == "wav":
                    pcm = wav_stream_header(SAMPLE_RATE) + pcm
        if self.stream_audio:
            out.append(pcm)
        else:
            self.pcm.append(pcm)
        return out

    async def _done(self, event: dict[str, Any]) -> list[str | bytes]:
        out: list[str | bytes] = []
        if event["utterance_id"] != self.current:
            self._next(event["utterance_id"])
            self.current = None  # no audio.start sent yet
        if event["status"] == "failed":
            out.append(_json({"type": "error", "message": event["error"]["message"], "code": event["error"]["code"]}))
        else:
            if not self.stream_audio or event["utterance_id"] != self.current:
                out.append(self._start(self.session.text[event["text_start"]:event["text_end"]]))
            if not self.stream_audio:
                wave = np.frombuffer(b"".join(self.pcm), dtype="<i2").astype(np.float32) / 32768.0
                out.append(await asyncio.to_thread(encode_speech, wave, SAMPLE_RATE, self.response_format))
            out.append(_json({"type": "audio.done", "utterance_index": self.utterance_index,
                              "sentence_index": self.sentence_index}))
            self.sentence_index += 1
        self.current, self.pcm = None, []
        self.spoken_end = max(self.spoken_end, event["text_end"])
        return out + self._answered_flushes()

    def _next(self, utterance_id: str) -> None:
        """The next utterance's events begin: its format is the config's in effect when it started."""
        self.current, self.pcm = utterance_id, []
        _, self.response_format, self.stream_audio = [f for f in self.formats if f[0] <= self.seen][-1]
        self.seen += 1

    def _start(self, text: str) -> str:
        start = {"type": "audio.start", "utterance_index": self.utterance_index,
                 "sentence_index": self.sentence_index, "sentence_text": text, "format": self.response_format}
        if self.stream_audio and self.response_format == "pcm":
            start.update(sample_rate=SAMPLE_RATE, channels=1)
        return _json(start)

    def _answered_flushes(self) -> list[str | bytes]:
        """`session.done` for each flush whose text is all spoken (or was blank: nothing to say)."""
        out: list[str | bytes] = []
        while self.flushes and not self.session.text[self.spoken_end:self.flushes[0]].strip():
            self.spoken_end = max(self.spoken_end, self.flushes.pop(0))
            out.append(_json({"type": "session.done", "utterance_index": self.utterance_index,
                              "total_sentences": self.sentence_index}))
            self.utterance_index += 1
            self.sentence_index = 0
        return out


def _json(event: dict[str, Any]) -> str:
    return json.dumps(event)
