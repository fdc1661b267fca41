"""The realtime session state machine: one per WebSocket.

    session = RealtimeSession(ctx, model, limits, send)
    await session.start()                 # session.created
    await session.handle(event)           # each client event, in order; ProtocolError -> `error`
    await session.close()                 # the socket is gone: abort the response in every stage

Turns come from `input_audio_buffer.commit`, from `conversation.item.create`, or, with server
VAD, from speech that stops (then a response starts by itself when `create_response`). Speech
that starts while a response is running or its audio is still playing cancels the response
(`interrupt_response`) and cuts the reply in the history at what was heard (barge-in; see
docs/realtime.md).

What a client sends is decoded off the event loop (large audio chunks and items in a worker
thread), and a user image is fetched once, through the media gate, when its item is created:
the session's images together stay within one request's media limits (every response sends
them all), and the conversation within its item and text bounds.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.media_fetch import fetch_media
from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.audio import (
    MODEL_RATE, AudioDecodeError, InputAudioStream, model_samples, samples_to_ms,
)
from vllm_omni.entrypoints.openai.realtime.conversation import Conversation, Item, Part, new_id
from vllm_omni.entrypoints.openai.realtime.input_buffer import BufferFull, InputBuffer
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.realtime.protocol import (
    BufferAppend, BufferClear, BufferCommit, ClientEvent, ItemCreate, ItemDelete, ItemIn, ItemRetrieve,
    ItemTruncate, ProtocolError, ResponseCancel, ResponseCreate, ResponseIn, SessionUpdate,
)
from vllm_omni.entrypoints.openai.realtime.response import ResponsePlan, ResponseRun
from vllm_omni.entrypoints.openai.realtime.session_config import ModelAbilities, SessionConfig, response_voice
from vllm_omni.entrypoints.openai.realtime.vad import FRAME, SileroStream, SpeechSegmenter, SpeechStarted
from vllm_omni.entrypoints.openai.serving_base import ServingContext
from vllm_omni.multimodal.media import open_image
from vllm_omni.multimodal.media_policy import MediaBudget, MediaError

MIN_COMMIT_MS = 100  # OpenAI's minimum for a committed buffer
# How long a turn's response waits for the reply its speech cancelled to wind down (the abort
# reaching every stage, then its response.done); past it the turn gets no response of its own.
CANCELLED_REPLY_WAIT_S = 60.0
OFF_LOOP_BYTES = 64 * 1024  # audio chunks larger than this are decoded in a worker thread

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RealtimeSession:
    def __init__(self, ctx: ServingContext, model: ModelAbilities, limits: RealtimeLimits, send: Send) -> None:
        self.ctx, self.model, self.limits, self.send = ctx, model, limits, send
        self.id = new_id("sess")
        self.created_at = time.time()
        self.config = SessionConfig.default(model)
        self.conversation = Conversation(limits.max_history_audio_s, limits.max_items, limits.max_text_chars)
        self.input = InputAudioStream(self.config.input_format)
        self.buffer = InputBuffer(int(limits.max_input_audio_s * MODEL_RATE))
        self.vad: SileroStream | None = None
        self.segmenter: SpeechSegmenter | None = None
        self.speech_item_id: str | None = None  # the id the speech under way will get when committed
        self.response: ResponseRun | None = None
        self._turn_after_cancel: asyncio.Task[None] | None = None  # see _respond_to_turn
        self._handlers: dict[type, Callable[[Any], Awaitable[None]]] = {
            SessionUpdate: self._session_update, BufferAppend: self._append, BufferCommit: self._commit,
            BufferClear: self._clear, ItemCreate: self._item_create, ItemRetrieve: self._item_retrieve,
            ItemDelete: self._item_delete, ItemTruncate: self._item_truncate, ResponseCreate: self._response_create,
            ResponseCancel: self._response_cancel,
        }

    # ------------------------------------------------------------------ lifecycle

    def _session_wire(self) -> dict[str, Any]:
        return self.config.wire(self.id, int(self.created_at + self.limits.max_session_s))

    async def start(self) -> None:
        await self._configure_vad()
        await self.send(events.event("session.created", session=self._session_wire()))

    @property
    def busy(self) -> bool:
        return self.response is not None and self.response.active

    async def close(self) -> None:
        if self._turn_after_cancel is not None:
            self._turn_after_cancel.cancel()
        run = self.response
        if run is not None and run.task is not None:
            run.cancel("client_disconnected")
            await asyncio.gather(run.task, return_exceptions=True)

    async def handle(self, event: ClientEvent) -> None:
        try:
            await self._handlers[type(event)](event)
        except ProtocolError as e:
            e.event_id = e.event_id or event.event_id
            raise

    # ------------------------------------------------------------------ session

    def _check_instructions(self, text: str | None, param: str) -> None:
        if text is not None and len(text) > self.limits.max_text_chars:
            raise ProtocolError(f"the instructions have {len(text)} characters, over the session's limit of "
                                f"{self.limits.max_text_chars} (--realtime-max-text-chars)", param=param)

    async def _session_update(self, ev: SessionUpdate) -> None:
        self._check_instructions(ev.session.instructions, "session.instructions")
        old = self.config
        self.config = old.updated(ev.session, self.model)
        if self.config.input_format != old.input_format:
            self.buffer.append(self.input.flush())
            self.input = InputAudioStream(self.config.input_format)
        if self.config.turn_detection != old.turn_detection:
            await self._configure_vad()
        await self.send(events.event("session.updated", session=self._session_wire()))

    async def _configure_vad(self) -> None:
        params = self.config.turn_detection
        self.segmenter = SpeechSegmenter(params) if params is not None else None
        self.speech_item_id = None
        if params is not None and self.vad is None:
            self.vad = await asyncio.to_thread(SileroStream)  # the first session loads the model

    # ------------------------------------------------------------------ input audio

    async def _append(self, ev: BufferAppend) -> None:
        try:
            self.buffer.check_room(model_samples(len(ev.audio), self.input.format))  # before decoding
            samples = await _off_loop(len(ev.audio), self.input.decode, ev.audio)
            self.buffer.append(samples)
        except AudioDecodeError as e:
            raise ProtocolError(str(e), code="invalid_audio", param="audio") from None
        except BufferFull as e:
            raise ProtocolError(str(e), code="input_audio_buffer_full", param="audio") from None
        if self.segmenter is not None:
            await self._detect_speech()

    async def _detect_speech(self) -> None:
        assert self.vad is not None and self.segmenter is not None
        frames = self.buffer.pending_frames()
        first = self.buffer.vad_done - frames.size  # timeline index of the first frame
        probabilities = await asyncio.to_thread(self.vad.probabilities, frames) if frames.size else []
        for change in self.segmenter.feed(probabilities):
            at = first + change.frame * FRAME
            if isinstance(change, SpeechStarted):
                await self._speech_started(at)
            else:
                await self._speech_stopped(at)
        if not self.segmenter.in_speech:  # silence: keep only what prefix padding may need
            pad = self.segmenter.params.prefix_padding_ms * MODEL_RATE // 1000
            self.buffer.drop_before(self.buffer.vad_done - pad)

    async def _speech_started(self, at: int) -> None:
        assert self.segmenter is not None
        self.speech_item_id = new_id("item")
        self.buffer.drop_before(at - self.segmenter.params.prefix_padding_ms * MODEL_RATE // 1000)
        await self.send(events.event("input_audio_buffer.speech_started", audio_start_ms=samples_to_ms(at, MODEL_RATE),
                                     item_id=self.speech_item_id))
        if self.segmenter.params.interrupt_response:
            await self._barge_in()

    async def _speech_stopped(self, at: int) -> None:
        assert self.segmenter is not None
        item_id, self.speech_item_id = self.speech_item_id or new_id("item"), None
        await self.send(events.event("input_audio_buffer.speech_stopped", audio_end_ms=samples_to_ms(at, MODEL_RATE),
                                     item_id=item_id))
        await self._commit_audio(self.buffer.take(at), item_id)
        if self.segmenter.params.create_response:
            await self._respond_to_turn()

    async def _respond_to_turn(self) -> None:
        """The response to a turn that server VAD ended: now, or, when this turn's speech cancelled
        the reply (barge-in) and that reply is still winding down, as soon as its response.done is
        out. (Under load the turn can end first: dropping its response would lose the turn.) A
        reply that was not cancelled keeps the turn waiting for the client's response.create."""
        run = self.response
        if run is None or not run.active:
            await self._start_response(None)
        elif run.cancel_reason is not None and run.task is not None and (
                self._turn_after_cancel is None or self._turn_after_cancel.done()):  # one answers every such turn
            self._turn_after_cancel = asyncio.create_task(self._respond_after(run.task))

    async def _respond_after(self, cancelled: asyncio.Task[None]) -> None:
        await asyncio.wait({cancelled}, timeout=CANCELLED_REPLY_WAIT_S)
        if self.busy:
            return  # still winding down, or the client already asked for a response
        try:
            await self._start_response(None)
        except ProtocolError as e:
            await self.send(events.error(e))

    async def _barge_in(self) -> None:
        """Speech while the model talks: stop it, and keep in the history only what was heard."""
        run = self.response
        if run is None:
            return
        now = time.monotonic()
        heard = run.played_ms(now)
        # A reply still being generated is cut too: its text runs ahead of its audio.
        unheard = run.speaks and (run.active or run.playing(now))
        run.cancel("turn_detected")
        if unheard:
            Conversation.cut(run.part, heard)
            await self.send(events.event("conversation.item.truncated", item_id=run.item.id, content_index=0,
                                         audio_end_ms=heard))

    async def _commit(self, ev: BufferCommit) -> None:
        self.buffer.append(self.input.flush())
        if len(self.buffer) * 1000 < MIN_COMMIT_MS * MODEL_RATE:
            raise ProtocolError(f"the input audio buffer holds {samples_to_ms(len(self.buffer), MODEL_RATE)} ms of "
                                f"audio; a commit needs at least {MIN_COMMIT_MS} ms", code="input_audio_buffer_commit_empty")
        item_id, self.speech_item_id = self.speech_item_id or new_id("item"), None
        if self.segmenter is not None:
            self.segmenter.reset()
        await self._commit_audio(self.buffer.take(), item_id)

    async def _commit_audio(self, samples: np.ndarray, item_id: str) -> None:
        item = Item("user", [Part("input_audio", audio=samples)], id=item_id)
        previous = self.conversation.items[-1].id if self.conversation.items else None
        await self.send(events.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        await self._add_item(item, None)

    async def _clear(self, ev: BufferClear) -> None:
        self.input.flush()
        self.buffer.clear()
        if self.segmenter is not None:
            self.segmenter.reset()
        self.speech_item_id = None
        await self.send(events.event("input_audio_buffer.cleared"))

    # ------------------------------------------------------------------ conversation

    async def _add_item(self, item: Item, previous_item_id: str | None) -> None:
        dropped = self.conversation.add(item, previous_item_id)
        previous = self.conversation.previous_id(item)
        for old in dropped:
            await self.send(events.event("conversation.item.deleted", item_id=old.id))
        await self.send(events.event("conversation.item.added", previous_item_id=previous, item=item.wire()))
        await self.send(events.event("conversation.item.done", previous_item_id=previous, item=item.wire()))

    async def _item_create(self, ev: ItemCreate) -> None:
        item = await self._item(ev.item)
        if item.audio_seconds() > self.limits.max_input_audio_s:
            raise ProtocolError(f"the item holds {item.audio_seconds():.1f} s of audio, over the "
                                f"{self.limits.max_input_audio_s:.0f} s limit", code="input_audio_too_long",
                                param="item.content")
        if item.text_chars() > self.limits.max_text_chars:
            raise ProtocolError(f"the item holds {item.text_chars()} characters of text, over the session's limit "
                                f"of {self.limits.max_text_chars} (--realtime-max-text-chars)", param="item.content")
        await self._add_item(item, ev.previous_item_id)

    async def _item(self, given: ItemIn) -> Item:
        allowed = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
                   "assistant": ("output_text", "output_audio", "text")}[given.role]
        budget = self._image_budget()
        parts = []
        for i, c in enumerate(given.content):
            param = f"item.content.{i}"
            if c.type not in allowed:
                raise ProtocolError(f"a {given.role} message cannot hold {c.type!r} content; use {list(allowed)}",
                                    param=f"{param}.type")
            parts.append(await self._part(c.type, c, param, budget))
        return Item(given.role, parts, **({"id": given.id} if given.id else {}))

    def _image_budget(self) -> MediaBudget:
        """Every response sends all of the conversation's images: together they are one request's media."""
        budget = MediaBudget(self.ctx.media)
        for image in (im for item in self.conversation.items for im in item.images()):
            budget.take_item()
            budget.take_bytes(len(image))
        return budget

    async def _part(self, kind: str, c: Any, param: str, budget: MediaBudget) -> Part:
        if kind == "input_audio":
            if c.audio is None:
                raise ProtocolError("input_audio content needs 'audio' (base64)", param=f"{param}.audio")
            if model_samples(len(c.audio), self.config.input_format) > self.limits.max_input_audio_s * MODEL_RATE:
                raise ProtocolError(f"the item's audio is over the {self.limits.max_input_audio_s:.0f} s limit",
                                    code="input_audio_too_long", param=f"{param}.audio")
            try:
                wave = await asyncio.to_thread(_decode_whole, self.config.input_format, c.audio)
            except AudioDecodeError as e:
                raise ProtocolError(str(e), code="invalid_audio", param=f"{param}.audio") from None
            return Part("input_audio", audio=wave, transcript=c.transcript)
        if kind == "input_image":
            if not c.image_url:
                raise ProtocolError("input_image content needs 'image_url'", param=f"{param}.image_url")
            return Part("input_image", image_url=c.image_url, image=await self._image(c.image_url, budget, param))
        if kind == "output_audio":
            return Part("output_audio", transcript=c.transcript or "")
        if c.text is None:
            raise ProtocolError(f"{kind} content needs 'text'", param=f"{param}.text")
        return Part("output_text" if kind == "text" else kind, text=c.text)

    async def _image(self, url: str, budget: MediaBudget, param: str) -> bytes:
        """The image behind `url`, fetched once through the media gate; its header checked."""
        try:
            source = await fetch_media(url, "image", self.ctx.media, budget)
            return await asyncio.to_thread(_image_bytes, source, self.ctx.media.limits)
        except (APIError, MediaError) as e:
            raise ProtocolError(getattr(e, "message", str(e)), code="invalid_image", param=f"{param}.image_url") from None

    async def _item_retrieve(self, ev: ItemRetrieve) -> None:
        item = self.conversation.get(ev.item_id)
        await self.send(events.event("conversation.item.retrieved", item=item.wire()))

    async def _item_delete(self, ev: ItemDelete) -> None:
        if self.busy and self.response is not None and self.response.item.id == ev.item_id:
            raise ProtocolError("the item is being generated; cancel the response first", param="item_id")
        self.conversation.delete(ev.item_id)
        await self.send(events.event("conversation.item.deleted", item_id=ev.item_id))

    async def _item_truncate(self, ev: ItemTruncate) -> None:
        self.conversation.truncate(ev.item_id, ev.content_index, ev.audio_end_ms)
        await self.send(events.event("conversation.item.truncated", item_id=ev.item_id,
                                     content_index=ev.content_index, audio_end_ms=ev.audio_end_ms))

    # ------------------------------------------------------------------ responses

    async def _response_create(self, ev: ResponseCreate) -> None:
        if self.busy:
            raise ProtocolError("a response is already in progress; cancel it or wait for response.done",
                                code="conversation_already_has_active_response")
        await self._start_response(ev.response)

    async def _start_response(self, spec: ResponseIn | None) -> None:
        cfg, spec = self.config, spec or ResponseIn()
        self._check_instructions(spec.instructions, "response.instructions")
        modalities = (self.model.check_modalities(spec.output_modalities, "response.output_modalities")
                      if spec.output_modalities is not None else cfg.output_modalities)
        voice = response_voice(spec.audio.output if spec.audio else None, self.model, cfg.voice)
        max_tokens = cfg.max_output_tokens if spec.max_output_tokens is None else (
            None if spec.max_output_tokens == "inf" else spec.max_output_tokens)
        instructions = cfg.instructions if spec.instructions is None else spec.instructions
        messages = self.conversation.messages(instructions)
        item = Item("assistant", [], status="in_progress")
        previous = self.conversation.items[-1].id if self.conversation.items else None
        self.conversation.add(item)
        plan = ResponsePlan(new_id("resp"), self.conversation.id, messages, modalities, voice, max_tokens,
                            spec.metadata)
        self.response = ResponseRun(plan, item, previous, self.ctx, self.send)
        self.response.task = asyncio.create_task(self.response.run())

    async def _response_cancel(self, ev: ResponseCancel) -> None:
        run = self.response
        if run is None or not run.active:
            raise ProtocolError("there is no response in progress to cancel", code="response_cancel_not_active")
        if ev.response_id is not None and ev.response_id != run.plan.id:
            raise ProtocolError(f"response {ev.response_id!r} is not in progress", param="response_id")
        run.cancel("client_cancelled")


async def _off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread when the input is large: the event loop serves everyone."""
    return await asyncio.to_thread(fn, *args) if size > OFF_LOOP_BYTES else fn(*args)


def _decode_whole(fmt: Any, audio: str) -> np.ndarray:
    stream = InputAudioStream(fmt)
    return np.concatenate([stream.decode(audio), stream.flush()])


def _image_bytes(source: Any, limits: Any) -> bytes:
    data = source.read_bytes() if not isinstance(source, bytes) else source  # a vetted local file
    open_image(data, limits)  # a header within the pixel limit; decoded on each turn by the processor
    return data
