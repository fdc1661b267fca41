"""`AsyncOmni`: asyncio API over a multi-stage pipeline (what the HTTP server uses).

    omni = AsyncOmni(model="Qwen/Qwen2.5-Omni-7B")
    async for out in omni.generate("Hello", request_id="r1"):
        ...  # one OmniRequestOutput per final-output stage, as each finishes
    async for out in omni.generate(prompt, request_id="r2", modalities=["text"], output_partial=True):
        print(out.delta.text, end="")  # streamed text; out.finished marks the last one
"""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.pipeline_sleep import SLEEPING, PipelineSleepingError
from vllm_omni.engine.request_state import RequestDone
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.outputs import OmniRequestOutput, RequestOutputKind

logger = logging.getLogger(__name__)

# Prompts processed at once (chat template, media decoding, features), each in a thread of its
# own: a few requests with large media must not take every thread of the loop's default pool
# (5 + cores) from the plain requests and the server's other work.
PREPARE_THREADS = 32


class RequestFailedError(RuntimeError):
    """A request failed in a stage (its message names the stage and the reason)."""

    def __init__(self, request_id: str, stage_id: int | None, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.stage_id = stage_id


class PipelineOverloadedError(RequestFailedError):
    """Not admitted: the pipeline is at its playback load (admission policy reject, or the queue's
    wait ran out). The server answers 429."""


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

    # Requests started with input_complete=False and not submitted yet: their appends so far.
    _early_inputs: dict[str, list[tuple[dict[str, Any], bool]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early_inputs = {}

    async def generate(
        self,
        prompt: Any,
        sampling_params_list: Sequence[Any] | None = None,
        *,
        request_id: str | None = None,
        modalities: Sequence[str] | None = None,
        output_partial: bool = False,
        output_kind: RequestOutputKind | None = None,
        input_complete: bool = True,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Yield each final-output stage's OmniRequestOutput as it finishes.

        `modalities`: as in Omni.generate (only these outputs; only the stages they need).
        `output_partial`: also yield `finished=False` outputs of the final stages as they grow
        (text: every step; audio: every chunk), each with the cumulative output in
        `request_output` and the new part in `delta` (OmniRequestOutput's docstring).
        `output_kind` says it exactly (vLLM's RequestOutputKind; default: CUMULATIVE with
        output_partial, else FINAL_ONLY); DELTA yields partial outputs that hold only what is new.
        `input_complete=False`: more of the prompt follows (`append_input`), for a model whose
        first stage takes input as it comes (Qwen3-TTS: text as it is written); the request
        runs as far as its input allows and waits for the rest.

        The prompt is processed (chat template, media, features) in a worker thread, so the
        caller's loop keeps serving; a bad prompt raises ValueError from the first iteration,
        before anything is queued. Raises RequestFailedError when a stage fails the request;
        closing the generator early (e.g. the client disconnected) aborts the request in
        every stage.
        """
        request_id = request_id or f"omni-{uuid.uuid4().hex}"
        if output_kind is None:
            output_kind = RequestOutputKind.CUMULATIVE if output_partial else RequestOutputKind.FINAL_ONLY
        loop = asyncio.get_running_loop()
        sink = _AsyncSink(loop, output_kind)
        if not input_complete:  # appends that come before the submission wait for it, in order
            self._early_inputs[request_id] = []
        try:
            sub = await loop.run_in_executor(self._prepare_pool, functools.partial(
                self._runtime.prepare, request_id, prompt, sampling_params_list, sink, modalities, input_complete))
            self._runtime.submit(sub)
            for info, final in self._early_inputs.get(request_id, ()):
                self._runtime.append_input(request_id, info, final)
        finally:
            self._early_inputs.pop(request_id, None)
        done = False
        try:
            while True:
                # Bounded by the orchestrator: stage deadlines end every request, and a stopped
                # orchestrator fails all of them.
                item = await sink.queue.get()
                if isinstance(item, RequestDone):
                    done = True
                    if item.error == SLEEPING:  # the pipeline fell asleep before the request reached it
                        raise PipelineSleepingError()
                    if item.error is not None:
                        error = PipelineOverloadedError if item.overloaded else RequestFailedError
                        raise error(request_id, item.failed_stage, item.error)
                    return
                yield item
        finally:
            if not done and not self._runtime.closed:
                self._runtime.abort(request_id)

    @functools.cached_property
    def _prepare_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="omni-prepare")

    def close(self) -> None:
        super().close()
        if "_prepare_pool" in self.__dict__:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def append_input(self, request_id: str, delta: Any, final: bool = False) -> None:
        """More of the prompt of a request started with input_complete=False (e.g. {"prompt":
        " more text"}), in order, from the loop that iterates its generate(); `final`: nothing
        more follows. Processed here (a few tokens): ValueError on bad input. Before the request
        is submitted it waits for the submission; a request that finished ignores it."""
        info = self._runtime.process_delta(delta)
        early = self._early_inputs.get(request_id)
        if early is not None:
            early.append((info, final))
        else:
            self._runtime.append_input(request_id, info, final)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._runtime.abort(rid)

    async def get_stage_stats(self, stage_id: int) -> StageStats:
        return await self._runtime.stage_stats_async(stage_id)

    # vLLM's AsyncLLM sleep mode API (Omni.sleep has the details).
    async def sleep(self, level: int = 1) -> None:
        await self._runtime.sleep_async(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._runtime.wake_up_async(tags)

    async def is_sleeping(self) -> bool:
        return self._runtime.is_sleeping

    @property
    def sleep_mode(self) -> bool:
        """Whether any stage runs in sleep mode (the server then has its /sleep routes)."""
        return self._runtime.orchestrator.sleep_mode.enabled

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)
