"""Restart stages that die or hang: exponential backoff, a bounded number of attempts.

    supervisor = StageSupervisor(restart=fleet.restart_replica, max_restarts=3)
    supervisor.on_down(stage_id, reason)     # from the stage client; schedules a restart
    supervisor.retry_after(stage_id)         # seconds until the stage should be back, or None

A stage that goes DOWN (its process exited, or it sent no heartbeat for the deadline and was
killed) is restarted after `backoff_s`, doubling per consecutive failure up to
`max_backoff_s`. A restart that fails (the new process does not come up) counts as another
failure. After `max_restarts` consecutive failures the stage stays down and `/health` says
why. A stage that has served for `stable_after_s` since its last restart starts with a clean
count, so an occasional crash over days never exhausts the budget.

The supervisor keys what it restarts by any hashable that prints as its name: the stage fleet
passes one `replica_pool.ReplicaRef` per replica, so each replica of a stage is restarted (and
counted) on its own.

Requests are not held while a stage restarts: those in flight at the crash have already
failed (the orchestrator fails them at once), and new ones that need the stage fail fast with
the expected wait (`retry_after`), which the server sends as 503 + Retry-After.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class _StageRecord:
    failures: int = 0  # consecutive failures (crashes and failed restarts)
    up_since: float | None = None  # when the stage last came (back) up
    startup_s: float = 10.0  # how long its last successful start took: the Retry-After estimate
    next_attempt_at: float | None = None  # set while a restart is pending or running
    gave_up: str | None = None  # why the stage stays down


class StageSupervisor:
    def __init__(self, restart: Callable[[Hashable], Awaitable[None]], max_restarts: int, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, stable_after_s: float = 60.0) -> None:
        self._restart = restart  # relaunches the stage; raises when it does not come up
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self._records: dict[Hashable, _StageRecord] = {}
        self._tasks: dict[Hashable, asyncio.Task[None]] = {}
        self._closed = False

    def started(self, stage_id: Hashable, startup_s: float) -> None:
        """The stage came up (at pipeline start or after a restart), taking `startup_s`."""
        record = self._records.setdefault(stage_id, _StageRecord())
        record.up_since = time.monotonic()
        record.startup_s = startup_s

    def on_down(self, stage_id: Hashable, reason: str) -> None:
        if self._closed or stage_id in self._tasks:  # a running restart handles its own failure
            return
        record = self._records.setdefault(stage_id, _StageRecord())
        if record.up_since is not None and time.monotonic() - record.up_since >= self.stable_after_s:
            record.failures = 0  # it had been serving long enough: this is a new incident
        record.up_since = None
        if record.failures + 1 > self.max_restarts:
            # No restart left: down at once, never "restarting" for the loop turn a task would take.
            record.failures += 1
            self._give_up(stage_id, record, reason)
            return
        self._tasks[stage_id] = asyncio.get_running_loop().create_task(
            self._supervise(stage_id, record, reason), name=f"{stage_id} supervisor")

    def _give_up(self, stage_id: Hashable, record: _StageRecord, reason: str) -> None:
        record.gave_up = (f"not restarted: failed {record.failures} times in a row "
                          f"(--max-stage-restarts {self.max_restarts}); last: {reason}")
        record.next_attempt_at = None
        logger.error("%s stays down: %s", stage_id, record.gave_up)

    async def _supervise(self, stage_id: Hashable, record: _StageRecord, reason: str) -> None:
        try:
            while True:
                record.failures += 1
                if record.failures > self.max_restarts:
                    self._give_up(stage_id, record, reason)
                    return
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (record.failures - 1))
                record.next_attempt_at = time.monotonic() + delay
                logger.warning("%s is down (%s); restart %d of %d in %.1fs", stage_id, _last_line(reason),
                               record.failures, self.max_restarts, delay)
                await asyncio.sleep(delay)
                try:
                    await self._restart(stage_id)
                except Exception as e:  # noqa: BLE001 - a failed restart is one more failure, retried
                    reason = str(e)
                    logger.error("%s: restart %d failed: %s", stage_id, record.failures, _last_line(reason))
                    continue
                record.next_attempt_at = None
                logger.info("%s is back up after restart %d", stage_id, record.failures)
                return
        finally:
            self._tasks.pop(stage_id, None)

    def restarting(self, stage_id: Hashable) -> bool:
        return stage_id in self._tasks

    def gave_up(self, stage_id: Hashable) -> str | None:
        record = self._records.get(stage_id)
        return record.gave_up if record is not None else None

    def retry_after(self, stage_id: Hashable) -> float | None:
        """Seconds until a restarting stage should serve again (the backoff left plus its last
        start-up time); None when no restart is coming."""
        record = self._records.get(stage_id)
        if record is None or stage_id not in self._tasks or record.next_attempt_at is None:
            return None
        return max(0.0, record.next_attempt_at - time.monotonic()) + record.startup_s

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown reason"
