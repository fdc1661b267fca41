"""One speech socket session: text comes in as it is written, speech goes out as it is made.

    session = SpeechStreamSession(ctx, speech, limits, send)
    await session.handle(event)        # session.update / input_text.append / .flush / .end
    session.pending_chars              # received and not yet read by the talker (backpressure)
    await session.close()              # aborts the utterance under way

Text is cut into phrases (speech_stream_protocol.PhraseCutter). The first phrase starts an
utterance: one talker request whose text streams in (AsyncOmni.generate(input_complete=False));
each later phrase is appended to that same request (append_input), so the talker keeps its
context and prosody across phrases. A flush ends the utterance (the talker gets tts_eos and
finishes speaking); text after it starts the next utterance once this one's audio is made.

Each `speech.audio.delta` carries PCM16 (24 kHz, mono, base64) and the span of the received
text [text_start, text_end) the talker had read by the chunk's last frame: it reads one token
per frame, so the span ends at token min(read in the prompt + frames, tokens handed to it).
Speech lags the text it reads by a few words, and a talker that waited with tts_pad rows
(max_frames_per_token) read less than that: spans are exact only while the text stays ahead of
the talker. `speech.audio.done` closes an utterance with its whole span and usage. An
utterance the talker ends early (EOS, max_tokens) gives back the text it did not read: it
starts the next one.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError
from vllm_omni.entrypoints.openai.serving_base import engine_error
from vllm_omni.entrypoints.openai.speech_audio import pcm16
from vllm_omni.entrypoints.openai.speech_stream_protocol import (
    MAX_PHRASE_CHARS, PhraseCutter, SessionUpdate, StreamEvent, TextAppend, TextEnd, TextFlush, check_session,
    sampling_overrides,
)
from vllm_omni.entrypoints.openai.tts_limits import SpeechStreamLimits

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
ENDPOINT = "/v1/audio/speech/stream"


# The talker reads a text token a frame, ~4 times faster than it speaks: text written at speaking
# pace runs out between phrases. By default it goes on speaking what it read (tts_pad rows) for up
# to 4 frames per token read, so the audio does not stop there (0: it waits, and the speech is
# exactly that of the whole text at once; docs/tts.md).
DEFAULT_FRAMES_PER_TOKEN = 4.0


@dataclass(frozen=True)
class StreamConfig:
    model: str
    voice: str | None = None
    instructions: str | None = None
    language: str | None = None
    max_frames_per_token: float = DEFAULT_FRAMES_PER_TOKEN
    max_phrase_chars: int = MAX_PHRASE_CHARS
    phrase_ends: str = "clause"
    sampling: dict[str, Any] | None = None

    def wire(self, session_id: str) -> dict[str, Any]:
        return {"id": session_id, "object": "speech.session", **dataclasses.asdict(self),
                "response_format": "pcm", "sample_rate": 24000}


@dataclass
class Utterance:
    id: str
    start: int  # offset of its text in the session's text
    end: int  # end of the text handed to it
    prompt_read: int  # text tokens the talker reads in its prompt
    token_ends: list[int] = field(default_factory=list)  # offset after each handed token
    final: bool = False  # its text is complete (the talker got tts_eos)
    frames: int = 0
    spoken_to: int = 0  # text_end of its last delta
    task: asyncio.Task[None] | None = None

    def read_to(self) -> int:
        """Offset up to which the talker has read (at most what it was handed)."""
        read = min(self.prompt_read + self.frames, len(self.token_ends))
        return self.token_ends[read - 1] if read else self.start


class SpeechStreamSession:
    def __init__(self, ctx: Any, speech: Any, limits: SpeechStreamLimits, send: Send) -> None:
        self.ctx, self.speech, self.limits, self.send = ctx, speech, limits, send
        self.id = f"speech_sess_{uuid.uuid4().hex[:20]}"
        self.config = StreamConfig(model=ctx.served_names[0])
        self.processor = _input_processor(ctx)
        self.tokenizer = ctx.engine.get_tokenizer()
        self.samples_per_frame = speech.info.samples_per_frame
        self.text = ""  # every text delta received, in order (offsets index into it)
        self.handed = 0  # text handed to utterances; the rest waits for a phrase boundary
        self.utterance: Utterance | None = None  # the one being made (at most one)
        self.started = 0  # utterances started (in order: the next one's index)
        # A voice cloned for this session alone (upstream's inline ref_audio; the edge encodes it):
        # from the next utterance, instead of `voice`.
        self.reference: Any = None
        self.flushes: deque[int] = deque()  # offsets of the flushes not yet handed to an utterance
        self.ending = False  # input_text.end: close once the last audio is out
        self.progress = asyncio.Event()  # audio went out, or an utterance ended
        self.finished = asyncio.Event()  # ended and every utterance done

    # ------------------------------------------------------------------ events
    async def start(self) -> None:
        await self.send(events.event("session.created", session=self.config.wire(self.id)))

    async def handle(self, event: StreamEvent) -> None:
        try:
            if isinstance(event, SessionUpdate):
                await self._update(event)
            elif isinstance(event, TextAppend):
                await self._append(event.text)
            elif isinstance(event, TextFlush):
                await self._flush()
            elif isinstance(event, TextEnd):
                self.ending = True
                await self._flush()
                self._check_finished()
        except ProtocolError as e:
            e.event_id = e.event_id or event.event_id
            raise
        except APIError as e:  # a stage the utterance needs is down, the server is overloaded
            raise ProtocolError(e.message, code="server_error" if e.status >= 500 else "invalid_value",
                                kind="server_error" if e.status >= 500 else "invalid_request_error",
                                event_id=event.event_id) from None

    @property
    def pending_chars(self) -> int:
        """Text received that the talker has not read yet."""
        read = self.utterance.read_to() if self.utterance is not None else self.handed
        return len(self.text) - read

    @property
    def busy(self) -> bool:
        return self.utterance is not None

    async def close(self) -> None:
        u = self.utterance
        if u is not None and u.task is not None:
            u.task.cancel()
            await asyncio.gather(u.task, return_exceptions=True)

    async def _update(self, ev: SessionUpdate) -> None:
        s = ev.session
        check_session(s, self.ctx.served_names)
        changes = {k: getattr(s, k) for k in ("voice", "instructions", "language", "max_frames_per_token",
                                              "max_phrase_chars", "phrase_ends") if getattr(s, k) is not None}
        if s.sampling is not None:
            changes["sampling"] = sampling_overrides(s.sampling)
        config = dataclasses.replace(self.config, **changes)
        self._options(config)  # refuse a bad voice or instructions now, not at the first phrase
        self.config = config
        await self.send(events.event("session.updated", session=config.wire(self.id)))

    async def _append(self, text: str) -> None:
        if self.ending:
            raise ProtocolError("the session is ending (input_text.end): no more text", code="session_ending")
        if len(self.text) + len(text) > self.limits.max_text_chars:
            raise ProtocolError(f"the session's text would exceed {self.limits.max_text_chars} characters "
                                "(--speech-stream-max-text-chars)", code="input_text_too_long")
        self.text += text
        await self._advance()

    async def _flush(self) -> None:
        self.flushes.append(len(self.text))
        await self._advance()

    # ------------------------------------------------------------------ utterances
    async def _advance(self) -> None:
        """Hand what the buffer allows to the talker: start an utterance, or append to it. A
        flush ends the utterance at its offset; text after it waits for the next utterance."""
        while True:
            u = self.utterance
            if u is not None and u.final:
                return  # the next utterance starts when this one ends (_done)
            flush = bool(self.flushes)
            buffered = self.text[self.handed:self.flushes[0] if flush else len(self.text)]
            cutter = PhraseCutter(self.config.max_phrase_chars, self.config.phrase_ends)
            piece = buffered if flush else buffered[:cutter.cut(buffered)]
            if u is None and not piece.strip():
                if not flush:
                    return
                self.handed += len(buffered)  # nothing to say before this flush
                self.flushes.popleft()
                continue
            if u is None:
                if not flush and self.processor.count_tokens(piece) < self._start_tokens():
                    return  # a cloned voice's reference must be covered by text first
                await self._start(piece, final=flush)
            elif piece or flush:
                self.ctx.engine.append_input(self._request_id(u), {"prompt": piece} if piece else {}, final=flush)
                self._hand(u, piece)
                u.final = flush
            if flush:
                self.flushes.popleft()
            return

    async def _start(self, text: str, final: bool) -> None:
        options = self._options(self.config)
        u = Utterance(id=f"utt_{uuid.uuid4().hex[:16]}", start=self.handed, end=self.handed,
                      prompt_read=max(1, self._start_tokens() - 1), final=final)
        prompt = {"prompt": text, "text_complete": final, "non_streaming_mode": False,
                  "max_frames_per_token": self.config.max_frames_per_token, **options}
        params = [self.config.sampling] + [None] * (self.ctx.shape.num_stages - 1)
        self.ctx.check_stages_up(self.ctx.shape.needed_stages(["audio"]))
        gen = self.ctx.engine.generate(prompt, params, request_id=self._request_id(u), modalities=["audio"],
                                       output_partial=True, input_complete=final)
        self._hand(u, text)
        self.utterance = u
        self.started += 1
        u.task = asyncio.create_task(self._speak(u, gen))

    def _hand(self, u: Utterance, text: str) -> None:
        if text:
            offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            u.token_ends += [u.end + end for _, end in offsets]
        u.end += len(text)
        self.handed = u.end

    async def _speak(self, u: Utterance, gen: Any) -> None:
        status, error, ticket = "completed", None, None
        try:
            ticket = await self.ctx.gate.admit()
            async for out in gen:
                audio = out.delta.multimodal_output.get("audio") if out.delta is not None else None
                if audio is not None and audio.numel():
                    await self._delta(u, audio.detach().float().cpu().numpy().reshape(-1))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed utterance is reported in-band; the session goes on
            err = engine_error(self.ctx, e)
            status, error = "failed", err if isinstance(err, APIError) else APIError(500, str(e))
        finally:
            if ticket is not None:
                ticket.release()
            await gen.aclose()  # a no-op when finished; else aborts the request in every stage
        await self._done(u, status, error)

    async def _delta(self, u: Utterance, wave: Any) -> None:
        u.frames += wave.size // self.samples_per_frame
        start, u.spoken_to = u.spoken_to or u.start, u.read_to()
        payload = await asyncio.to_thread(lambda: base64.b64encode(pcm16(wave)).decode())
        await self.send(events.event("speech.audio.delta", utterance_id=u.id, audio=payload, text_start=start,
                                     text_end=max(start, u.spoken_to)))
        self.progress.set()

    async def _done(self, u: Utterance, status: str, error: APIError | None) -> None:
        if error is None and not u.final:  # the talker stopped before the text's end: the rest goes on
            self.handed = u.spoken_to = max(u.start, min(u.read_to(), u.end))
            status = "stopped"
        else:  # (a failed utterance's text is dropped with the error: it would fail again)
            u.spoken_to = u.end
            self.handed = max(self.handed, u.end)
        fields: dict[str, Any] = {"utterance_id": u.id, "status": status, "text_start": u.start,
                                  "text_end": u.spoken_to,
                                  "usage": {"input_tokens": len(u.token_ends), "output_tokens": u.frames}}
        if error is not None:
            fields["error"] = {"type": "server_error" if error.status >= 500 else "invalid_request_error",
                               "code": str(error.status), "message": error.message}
        await self.send(events.event("speech.audio.done", **fields))
        self.ctx.metrics.observe_status(ENDPOINT, 200 if error is None else error.status)
        self.utterance = None
        self.progress.set()
        await self._advance()
        self._check_finished()

    def _check_finished(self) -> None:
        if self.ending and self.utterance is None and self.handed >= len(self.text) and not self.flushes:
            self.finished.set()

    # ------------------------------------------------------------------ helpers
    def _options(self, config: StreamConfig) -> dict[str, Any]:
        """The TTS prompt's voice options (APIError from the voices service -> ProtocolError)."""
        try:
            self.speech.check_instructions(config.instructions)
            if self.reference is not None:
                if config.voice is not None and self.speech.voices.store is not None \
                        and self.speech.voices.store.find(config.voice) is not None:
                    raise APIError(400, f"voice {config.voice!r} is a stored voice: give no ref_audio with it")
                options = {"cloned_voice": self.reference}
            else:
                options = self.speech.voices.speech_options(config.voice, False, config.instructions is not None)
        except APIError as e:
            raise ProtocolError(e.message, param=f"session.{e.param or 'voice'}") from None
        if config.instructions is not None and "instructions" not in options:
            options["instructions"] = config.instructions
        if config.language is not None:
            if config.language.lower() not in self.processor.languages:
                raise ProtocolError(f"unsupported language {config.language!r}; supported: {self.processor.languages}",
                                    param="session.language")
            options["language"] = config.language
        return options

    def _start_tokens(self) -> int:
        return self.processor.streamed_start_tokens(self._options(self.config))

    def _request_id(self, u: Utterance) -> str:
        return f"{self.id}-{u.id}"


def _input_processor(ctx: Any) -> Any:
    """The served TTS family's input processor (its token counts and stream thresholds)."""
    from vllm_omni.imports import import_dotted
    from vllm_omni.model_executor.models.families import family_of

    config = json.loads((Path(ctx.model_path) / "config.json").read_text(encoding="utf-8"))
    family = family_of(config)
    return import_dotted(family.input_processor)(ctx.model_path, ctx.engine.get_tokenizer())
