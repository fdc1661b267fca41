"""Sleep mode of a pipeline: vLLM's sleep / wake_up / is_sleeping, sent to every stage that runs in
sleep mode (`enable_sleep_mode`) as a SleepRequest; each stage's worker frees or rebuilds its engine
(worker/sleep_mode.py).

- Sleeping needs an idle pipeline: with requests in flight it is refused (`SleepConflict`, HTTP
  409), as vLLM expects the engine to be idle. From the moment sleep is asked, requests are
  refused (`PipelineSleepingError`, HTTP 503) until every stage is awake again.
- A stage that refuses or fails to sleep (a request reached it just before) makes the whole sleep
  fail: the stages that did sleep are woken again.
- Waking with some tags only (vLLM's `tags=weights`, then `tags=kv_cache`) records them; a stage
  builds its engine once both are woken, and the pipeline serves again when every stage is awake.
- Stage replicas that are down are skipped: one that restarts comes back awake, and a later
  wake_up is a no-op for it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.messages import SleepStatus
from vllm_omni.engine.stage_client import StageClient, StageState

logger = logging.getLogger(__name__)

SLEEPING = "the server is sleeping (sleep mode): POST /wake_up to wake it"


class PipelineSleepingError(RuntimeError):
    """A request arrived while the pipeline sleeps (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__(SLEEPING)


class SleepConflict(RuntimeError):
    """Sleep was asked while requests are in flight (HTTP 409)."""


class PipelineSleep:
    def __init__(self, pipeline: PipelineConfig, pools: dict[int, Any], timeout_s: float) -> None:
        """`pools`: the fleet's replica pools by stage; `timeout_s`: the most one stage may take to
        sleep or wake up (waking builds its engine: the stage start-up deadline)."""
        self.stage_ids = [s.stage_id for s in pipeline.stages if s.engine_args.enable_sleep_mode]
        self.pools = pools
        self.timeout_s = timeout_s
        self.sleeping = False  # read from other threads; written on the orchestrator's loop only
        self._busy = asyncio.Lock()  # one sleep or wake-up at a time

    @property
    def enabled(self) -> bool:
        return bool(self.stage_ids)

    async def sleep(self, level: int, in_flight: Callable[[], int]) -> None:
        self._check_enabled()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        async with self._busy:
            requests = in_flight()
            if requests:
                raise SleepConflict(f"cannot sleep while {requests} request(s) are in flight; retry when they end")
            self.sleeping = True  # no request is admitted from here on
            statuses = await self._tell_stages(sleep=True, level=level, tags=None)
            failed = [s for s in statuses if s.error is not None]
            if not failed:
                logger.info("the pipeline sleeps (level %d)", level)
                return
            await self._tell_stages(sleep=False, level=level, tags=None)  # those that slept wake up again
            self.sleeping = False
            message = "; ".join(s.error for s in failed if s.error)
            raise (SleepConflict if any(s.busy for s in failed) else RuntimeError)(f"cannot sleep: {message}")

    async def wake_up(self, tags: list[str] | None) -> None:
        self._check_enabled()
        async with self._busy:
            statuses = await self._tell_stages(sleep=False, level=1, tags=tags)
            failed = [s.error for s in statuses if s.error is not None]
            if failed:
                raise RuntimeError(f"cannot wake up: {'; '.join(failed)}")
            if not any(s.sleeping for s in statuses):
                self.sleeping = False
                logger.info("the pipeline is awake")

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("sleep mode is off: no stage runs with enable_sleep_mode (--enable-sleep-mode)")

    async def _tell_stages(self, sleep: bool, level: int, tags: list[str] | None) -> list[SleepStatus]:
        clients = [c for sid in self.stage_ids for c in self.pools[sid].clients() if c.state == StageState.UP]
        results = await asyncio.gather(*(c.sleep_control(sleep, level, tags, self.timeout_s) for c in clients),
                                       return_exceptions=True)
        return [r if isinstance(r, SleepStatus) else _failure(c, r) for c, r in zip(clients, results)]


def _failure(client: StageClient, exc: BaseException) -> SleepStatus:
    """A stage that did not answer (down, or past the deadline) as a status naming it."""
    return SleepStatus(nonce=-1, stage_id=client.stage_id, sleeping=False, error=f"{client.name}: {exc}")
