"""`AsyncOmni`: asyncio API over a multi-stage pipeline (what the HTTP server uses).

    omni = AsyncOmni(model="Qwen/Qwen2.5-Omni-7B")
    async for out in omni.generate("Hello", request_id="r1"):
        ...  # one OmniRequestOutput per final-output stage, as each finishes
    async for out in omni.generate(prompt, request_id="r2", modalities=["text"], output_partial=True):
        print(out.delta.text, end="")  # streamed text; out.finished marks the last one
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.request_state import RequestDone
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.outputs import OmniRequestOutput, RequestOutputKind

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """A request failed in a stage (its message names the stage and the reason)."""

    def __init__(self, request_id: str, stage_id: int | None, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.stage_id = stage_id


class _AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:  # called on the orchestrator's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            logger.debug("dropping an output for a closed event loop")


class AsyncOmni(OmniBase):
    """The asyncio API; constructor arguments: `OmniBase`. Construction blocks while the stages
    load their models: from async code, run it in a thread."""

    async def generate(
        self,
        prompt: Any,
        sampling_params_list: Sequence[Any] | None = None,
        *,
        request_id: str | None = None,
        modalities: Sequence[str] | None = None,
        output_partial: bool = False,
        output_kind: RequestOutputKind | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Yield each final-output stage's OmniRequestOutput as it finishes.

        `modalities`: as in Omni.generate (only these outputs; only the stages they need).
        `output_partial`: also yield `finished=False` outputs of the final stages as they grow
        (text: every step; audio: every chunk), each with the cumulative output in
        `request_output` and the new part in `delta` (OmniRequestOutput's docstring).
        `output_kind` says it exactly (vLLM's RequestOutputKind; default: CUMULATIVE with
        output_partial, else FINAL_ONLY); DELTA yields partial outputs that hold only what is new.

        The prompt is processed (chat template, media, features) in a worker thread, so the
        caller's loop keeps serving; a bad prompt raises ValueError from the first iteration,
        before anything is queued. Raises RequestFailedError when a stage fails the request;
        closing the generator early (e.g. the client disconnected) aborts the request in
        every stage.
        """
        request_id = request_id or f"omni-{uuid.uuid4().hex}"
        if output_kind is None:
            output_kind = RequestOutputKind.CUMULATIVE if output_partial else RequestOutputKind.FINAL_ONLY
        sink = _AsyncSink(asyncio.get_running_loop(), output_kind)
        sub = await asyncio.to_thread(self._runtime.prepare, request_id, prompt, sampling_params_list, sink,
                                      modalities)
        self._runtime.submit(sub)
        done = False
        try:
            while True:
                # Bounded by the orchestrator: stage deadlines end every request, and a stopped
                # orchestrator fails all of them.
                item = await sink.queue.get()
                if isinstance(item, RequestDone):
                    done = True
                    if item.error is not None:
                        raise RequestFailedError(request_id, item.failed_stage, item.error)
                    return
                yield item
        finally:
            if not done and not self._runtime.closed:
                self._runtime.abort(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._runtime.abort(rid)

    async def get_stage_stats(self, stage_id: int) -> StageStats:
        return await self._runtime.stage_stats_async(stage_id)

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)
