"""One response of a realtime session: a generation whose deltas become server events.

    run = ResponseRun(plan, deps)
    run.task = asyncio.create_task(run.run())   # response.created ... response.done
    run.cancel("turn_detected")                  # -> response.done with status "cancelled"

Built on `AsyncOmni.generate(..., output_partial=True)`: every output's `delta` (new text, new
audio rows) is forwarded the moment it arrives, so audio starts as soon as the pipeline
streams it. Cancelling the task closes the generator, which aborts the request in every stage.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.audio import pcm16_b64, samples_to_ms
from vllm_omni.entrypoints.openai.realtime.conversation import Item, Part
from vllm_omni.entrypoints.openai.serving_base import ServingContext, engine_error
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/realtime"
_ERROR_CODES = {400: "invalid_request", 413: "prompt_too_long", 429: "rate_limit_exceeded", 503: "stage_unavailable"}


@dataclass(frozen=True)
class ResponsePlan:
    id: str
    conversation_id: str
    messages: list[dict[str, Any]]
    modalities: tuple[str, ...]  # ("audio",): speech + transcript; ("text",): text only
    voice: str | None
    max_output_tokens: int | None
    metadata: dict[str, str] | None


class ResponseRun:
    def __init__(self, plan: ResponsePlan, item: Item, previous_item_id: str | None, ctx: ServingContext,
                 send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.plan, self.item, self.previous_item_id, self.ctx, self.send = plan, item, previous_item_id, ctx, send
        self.speaks = plan.modalities == ("audio",)
        self.part = Part("output_audio", transcript="") if self.speaks else Part("output_text", text="")
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: str | None = None
        self.started_at = time.monotonic()
        self.first_audio_at: float | None = None  # when the first audio delta went out
        self.prompt_tokens = self.output_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.samples_sent = 0

    # ---------------------------------------------------------------- what the session asks

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def cancel(self, reason: str) -> None:
        if self.active and self.task is not None:
            self.cancel_reason = reason
            self.task.cancel()

    def played_ms(self, now: float) -> int:
        """Where the client's playback is, assuming it plays from the first delta in real time."""
        if self.first_audio_at is None:
            return 0
        return min(self.part.audio_ms, int((now - self.first_audio_at) * 1000))

    def playing(self, now: float) -> bool:
        return self.speaks and self.first_audio_at is not None and self.played_ms(now) < self.part.audio_ms

    # ---------------------------------------------------------------- the run

    def _wire(self, status: str, **extra: Any) -> dict[str, Any]:
        p = self.plan
        return events.response_object(p.id, p.conversation_id, status, p.modalities, p.voice, p.max_output_tokens,
                                      p.metadata, **extra)

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.plan.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    async def run(self) -> None:
        await self.send(events.event("response.created", response=self._wire("in_progress")))
        await self.send(events.event("response.output_item.added", response_id=self.plan.id, output_index=0,
                                     item=self.item.wire()))
        await self.send(events.event("conversation.item.added", previous_item_id=self.previous_item_id,
                                     item=self.item.wire()))
        self.item.content.append(self.part)
        kind = "audio" if self.speaks else "text"
        await self.send(events.event("response.content_part.added", **self._ids(), part=self._part_wire(kind)))
        status, details = "completed", None
        try:
            await self._generate()
            if self.finish_reason == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            if self.cancel_reason is None:
                raise  # not ours: the server is shutting down
            status, details = "cancelled", {"type": "cancelled", "reason": self.cancel_reason}
        except Exception as e:  # noqa: BLE001 - a failed response is reported in-band; the session goes on
            status, details = "failed", {"type": "failed", "error": self._error(e)}
        await self._finish(kind, status, details)

    async def _generate(self) -> None:
        ctx, p = self.ctx, self.plan
        wanted = [m for m in ctx.shape.modalities() if m in ("text", "audio")] if self.speaks else ["text"]
        ctx.check_stages_up(ctx.shape.needed_stages(wanted))
        params: list[dict[str, Any] | None] = [None] * ctx.shape.num_stages
        if p.max_output_tokens is not None and ctx.shape.comprehension_stage is not None:
            params[ctx.shape.comprehension_stage] = {"max_tokens": p.max_output_tokens}
        prompt: dict[str, Any] = {"messages": p.messages}
        if self.speaks and p.voice is not None:
            prompt["speaker"] = p.voice
        ticket = await ctx.gate.admit()
        try:
            gen = ctx.engine.generate(prompt, params, request_id=p.id, modalities=wanted, output_partial=True)
            try:
                async for out in gen:
                    if self.cancel_reason is not None:
                        # The task's cancellation can be lost on the way: Python < 3.12's
                        # asyncio.wait_for (the link's send) returns normally when its write
                        # completes as the cancellation arrives (CPython gh-86296). The reason stays.
                        raise asyncio.CancelledError
                    await self._forward(out)
            finally:
                await gen.aclose()  # a no-op when finished; else aborts the request in every stage
        finally:
            ticket.release()

    async def _forward(self, out: OmniRequestOutput) -> None:
        delta = out.delta
        if delta is None:
            return
        if out.final_output_type == "text":
            ro = out.request_output
            self.prompt_tokens, self.cached_tokens = len(ro.prompt_token_ids), ro.num_cached_tokens
            self.output_tokens = len(ro.outputs[0].token_ids)
            self.finish_reason = ro.outputs[0].finish_reason or self.finish_reason
            if delta.text:
                await self._text(delta.text)
        elif out.final_output_type == "audio" and self.speaks:
            tensor = delta.multimodal_output.get("audio")
            if tensor is not None and tensor.numel():
                await self._audio(tensor.detach().float().cpu().numpy().reshape(-1))

    async def _text(self, text: str) -> None:
        if self.speaks:
            self.part.transcript = (self.part.transcript or "") + text
            await self.send(events.event("response.output_audio_transcript.delta", **self._ids(), delta=text))
        else:
            self.part.text = (self.part.text or "") + text
            await self.send(events.event("response.output_text.delta", **self._ids(), delta=text))

    async def _audio(self, wave: Any) -> None:
        payload = await asyncio.to_thread(pcm16_b64, wave)
        await self.send(events.event("response.output_audio.delta", **self._ids(), delta=payload))
        # Counted once sent: a cancelled response's history holds only audio the client got.
        self.samples_sent += wave.size
        self.part.audio_ms = samples_to_ms(self.samples_sent, OUTPUT_SAMPLE_RATE)
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            self.ctx.metrics.ttfa.observe(self.first_audio_at - self.started_at)

    def _error(self, exc: Exception) -> dict[str, Any]:
        err = engine_error(self.ctx, exc)
        if not isinstance(err, APIError):
            err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return {"type": "invalid_request_error" if err.status < 500 else "server_error",
                "code": _ERROR_CODES.get(err.status, "server_error"), "message": err.message}

    def _part_wire(self, kind: str) -> dict[str, Any]:
        if kind == "audio":
            return {"type": "audio", "transcript": self.part.transcript or ""}
        return {"type": "text", "text": self.part.text or ""}

    async def _finish(self, kind: str, status: str, details: dict[str, Any] | None) -> None:
        self.item.status = "completed" if status == "completed" else "incomplete"
        ids = self._ids()
        if kind == "audio":
            await self.send(events.event("response.output_audio.done", **ids))
            await self.send(events.event("response.output_audio_transcript.done", **ids,
                                         transcript=self.part.transcript or ""))
        else:
            await self.send(events.event("response.output_text.done", **ids, text=self.part.text or ""))
        await self.send(events.event("response.content_part.done", **ids, part=self._part_wire(kind)))
        await self.send(events.event("response.output_item.done", response_id=self.plan.id, output_index=0,
                                     item=self.item.wire()))
        await self.send(events.event("conversation.item.done", previous_item_id=self.previous_item_id,
                                     item=self.item.wire()))
        usage = events.usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)
        await self.send(events.event("response.done", response=self._wire(
            status, output=[self.item.wire()], status_details=details, usage=usage)))
        self._record(status)

    def _record(self, status: str) -> None:
        m = self.ctx.metrics
        m.observe_status(ENDPOINT, {"completed": 200, "incomplete": 200, "cancelled": 499}.get(status, 500))
        if status in ("completed", "incomplete"):
            m.observe_finished(ENDPOINT, time.monotonic() - self.started_at, self.prompt_tokens, self.output_tokens)
            if self.speaks:
                m.observe_audio(time.monotonic() - self.started_at, self.part.audio_ms / 1000)
