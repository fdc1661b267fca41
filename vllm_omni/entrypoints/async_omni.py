"""`AsyncOmni`: asyncio API over a multi-stage pipeline (what the HTTP server uses).

    omni = AsyncOmni(model="Qwen/Qwen2.5-Omni-7B")
    async for out in omni.generate("Hello", request_id="r1"):
        ...  # one OmniRequestOutput per final-output stage, as each finishes
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.request_state import RequestDone
from vllm_omni.engine.stage_client import StageHealth
from vllm_omni.entrypoints.omni import start_runtime
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """A request failed in a stage (its message names the stage and the reason)."""

    def __init__(self, request_id: str, stage_id: int | None, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.stage_id = stage_id


class _AsyncSink:
    wants_partial = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:  # called on the orchestrator's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            logger.debug("dropping an output for a closed event loop")


class AsyncOmni:
    def __init__(
        self,
        model: str | os.PathLike,
        stage_configs_path: str | None = None,
        deploy_config: str | None = None,
        stage_overrides: str | Mapping[Any, Any] | None = None,
        stage_init_timeout: float = 300,
        init_timeout: float = 600,
        shm_threshold_bytes: int = 65536,
        log_stats: bool = False,
        **engine_args: Any,
    ) -> None:
        # Startup blocks (stages load their models); run it in a thread from async code.
        self._runtime = start_runtime(model, stage_configs_path, deploy_config, stage_overrides, stage_init_timeout,
                                      init_timeout, shm_threshold_bytes, log_stats, engine_args)

    @property
    def pipeline(self) -> PipelineConfig:
        return self._runtime.pipeline

    def get_tokenizer(self) -> Any:
        return self._runtime.tokenizer

    async def generate(
        self,
        prompt: Any,
        sampling_params_list: Sequence[Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Yield each final-output stage's OmniRequestOutput as it finishes.

        Raises RequestFailedError when a stage fails the request; closing the generator
        early (e.g. the client disconnected) aborts the request in every stage.
        """
        request_id = request_id or f"omni-{uuid.uuid4().hex}"
        sink = _AsyncSink(asyncio.get_running_loop())
        self._runtime.submit(self._runtime.prepare(request_id, prompt, sampling_params_list, sink))
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

    def stage_health(self) -> list[StageHealth]:
        return self._runtime.health()

    async def get_stage_stats(self, stage_id: int) -> StageStats:
        return await self._runtime.stage_stats_async(stage_id)

    def close(self) -> None:
        self._runtime.close()

    def __enter__(self) -> AsyncOmni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)
