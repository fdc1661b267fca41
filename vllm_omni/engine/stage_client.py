"""The orchestrator's handle on one stage: launch, readiness, health, messages.

Each client owns one task that awaits its stage's socket and hands every message on
the moment it arrives. Liveness has two sources: the process sentinel (a local process
that exits is DOWN at once) and heartbeats. A stage silent for `heartbeat_timeout_s` is
DOWN at once (its requests fail or move, /health says so) but not killed yet: a stage that
was only paused (SIGSTOP, a stalled host) and speaks again within HANG_FACTOR times the
timeout is UP again at once. One still silent then is killed, so a hung stage does not keep
its GPU, and the supervisor restarts it. A client serves one launch of its stage: the
supervisor restarts a DOWN stage with a new client. A reader that fails (a bug, a broken
socket) takes its stage DOWN with it: a stage nobody listens to is not UP.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vllm_omni.engine.messages import (
    AbortRequests, Heartbeat, Shutdown, SleepRequest, SleepStatus, StageFatal, StageInitFailed, StageReady,
    StageStats, StatsRequest,
)
from vllm_omni.engine.stage_launcher import StageLauncher
from vllm_omni.engine.transport import OrchestratorChannel
from vllm_omni.stage_io import StageInfo

logger = logging.getLogger(__name__)

# A stage silent for this many heartbeat timeouts is hung: killed (and restarted by the supervisor).
HANG_FACTOR = 3
# How long a worker that exits while starting has for its StageInitFailed to arrive first.
EXIT_WHILE_STARTING_GRACE_S = 0.5


class StageState(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"
    RESTARTING = "restarting"  # down, and the supervisor is bringing it back (engine/supervisor.py)
    STOPPED = "stopped"  # closed on purpose


class StageDownError(RuntimeError):
    """A request needed a stage that is down (HTTP 503 material)."""

    def __init__(self, stage_id: int, message: str) -> None:
        super().__init__(message)
        self.stage_id = stage_id


@dataclass(frozen=True)
class StageHealth:
    stage_id: int
    model_stage: str | None
    state: StageState
    reason: str | None  # why it is DOWN
    pid: int | None
    seconds_since_heard: float | None
    info: StageInfo | None = None  # what the stage reported when it came up
    retry_after_s: float | None = None  # RESTARTING: when it should serve again
    replicas: tuple[ReplicaHealth, ...] = ()  # the stage's replicas (replica_pool.StagePool), one or more


@dataclass(frozen=True)
class ReplicaHealth:
    replica: int
    pid: int | None
    state: StageState
    queue: int  # requests routed to it and not finished there
    routed: int  # requests routed to it since the pipeline started
    reason: str | None
    retry_after_s: float | None = None


class StageClient:
    def __init__(
        self,
        stage_id: int,
        model_stage: str | None,
        launcher: StageLauncher,
        channel: OrchestratorChannel,
        *,
        on_message: Callable[[int, Any], None],
        on_down: Callable[[int, str], None],
        heartbeat_timeout_s: float,
        name: str | None = None,
        heartbeats_from_start: bool = False,
    ) -> None:
        self.stage_id = stage_id
        self.model_stage = model_stage
        # For messages; a replica of a stage with several names itself (replica_pool.ReplicaRef).
        self.name = name or f"stage {stage_id}" + (f" ({model_stage})" if model_stage else "")
        self.launcher = launcher
        self.channel = channel
        self._on_message = on_message
        self._on_down = on_down
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # A headless replica heartbeats from its registration on: one that falls silent while
        # starting is as hung as one that was serving (and frees its slot).
        self.heartbeats_from_start = heartbeats_from_start
        self.state = StageState.STARTING
        self.silent = False  # DOWN for missed heartbeats only, not killed yet: it may come back
        self._orphans: list[str] = []  # requests it held when it fell silent: aborted there if it comes back
        self.reason: str | None = None
        self.info: StageInfo | None = None  # what it reported when it came up
        self.pid: int | None = None
        self._last_heard: float | None = None
        self._started_at = time.monotonic()
        self._ready: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[int, asyncio.Future[Any]] = {}  # nonce -> the answer (StageStats, SleepStatus)
        # Sleeps and wake-ups under way: freeing or building an engine may starve the stage's heartbeat
        # thread of CPU for longer than the timeout; their own deadline bounds them instead.
        self._sleep_controls = 0
        self._nonces = itertools.count()

    # --- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._started_at = time.monotonic()
        self.launcher.start(on_exit=self._on_exit)
        self.pid = self.launcher.pid
        self._reader = loop.create_task(self._read_loop(), name=f"{self.name} reader")
        self._reader.add_done_callback(self._reader_ended)

    async def wait_ready(self, deadline: float, what: str) -> None:
        """Wait for StageReady until `deadline` (time.monotonic); `what` names the limit."""
        assert self._ready is not None, "start() first"
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.name} did not come up within {what}") from None

    async def close(self, timeout_s: float) -> None:
        """Ask the worker to stop, wait up to `timeout_s`, then terminate it and its group."""
        was_up = self.state == StageState.UP
        self.state = StageState.STOPPED
        if was_up:
            try:
                self.channel.send_nowait(Shutdown())
            except zmq.ZMQError as e:
                logger.warning("%s: cannot send shutdown (%s); terminating it", self.name, e)
        # Only a worker that is serving can act on Shutdown; any other is terminated at once.
        await self.launcher.stop(timeout_s, graceful=was_up)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.channel.close()
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(StageDownError(self.stage_id, f"{self.name} was shut down"))

    # --- requests -------------------------------------------------------------
    def send(self, msg: Any) -> None:
        if self.state != StageState.UP:
            raise StageDownError(self.stage_id, f"{self.name} is {self.state.value}: {self.reason or 'not ready'}")
        try:
            self.channel.send_nowait(msg)
        except zmq.ZMQError as e:  # unlimited queue: only a broken socket gets here
            self.mark_down(f"cannot send to its worker: {e}")
            raise StageDownError(self.stage_id, f"{self.name} is down: {self.reason}") from None

    async def stats(self, timeout_s: float) -> StageStats:
        return await self._ask(lambda nonce: StatsRequest(nonce), "a stats request", timeout_s)

    async def sleep_control(self, sleep: bool, level: int, tags: list[str] | None, timeout_s: float) -> SleepStatus:
        """Sleep (at `level`) or wake up (the parts `tags` names); the stage's SleepStatus."""
        self._sleep_controls += 1
        try:
            return await self._ask(lambda nonce: SleepRequest(nonce=nonce, sleep=sleep, level=level, tags=tags),
                                   "sleep" if sleep else "wake_up", timeout_s)
        finally:
            self._sleep_controls -= 1

    async def _ask(self, make: Callable[[int], Any], what: str, timeout_s: float) -> Any:
        """Send the message `make(nonce)` and wait for the answer with its nonce."""
        nonce = next(self._nonces)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[nonce] = fut
        try:
            self.send(make(nonce))
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.name} did not answer {what} within {timeout_s}s") from None
        finally:
            self._replies.pop(nonce, None)

    def health(self) -> StageHealth:
        heard = None if self._last_heard is None else time.monotonic() - self._last_heard
        return StageHealth(self.stage_id, self.model_stage, self.state, self.reason, self.pid, heard, self.info)

    # --- events ---------------------------------------------------------------
    def mark_down(self, reason: str) -> None:
        """DOWN for good: killed (a silent stage may be hung: it must not hold its devices)."""
        if self.state == StageState.STOPPED or (self.state == StageState.DOWN and not self.silent):
            return
        was_silent, self.silent = self.silent, False
        self.reason = reason  # before the state: whoever sees DOWN (another thread) sees why
        self.state = StageState.DOWN
        logger.error("%s is DOWN: %s", self.name, reason)
        if not was_silent:
            self._fail_waiters(reason)
        self.launcher.kill()
        self.channel.close_sender()  # nothing more goes to it; stops reconnect attempts too
        self._on_down(self.stage_id, reason)

    def remember_orphans(self, request_keys: list[str]) -> None:
        """The requests a silent stage held (they failed or moved): aborted there if it comes back."""
        self._orphans = list(request_keys)

    def _fall_silent(self, silent_s: float) -> None:
        """Missed heartbeats: DOWN (its requests fail or move), not killed yet."""
        self.state = StageState.DOWN
        self.silent = True
        self.reason = (f"no heartbeat for {silent_s:.1f}s (deadline {self.heartbeat_timeout_s}s); killed unless it "
                       f"answers within {HANG_FACTOR * self.heartbeat_timeout_s:.0f}s of silence")
        logger.error("%s is DOWN: %s", self.name, self.reason)
        self._fail_waiters(self.reason)
        self._on_down(self.stage_id, self.reason)

    def _revive(self, silent_s: float) -> None:
        self.state = StageState.UP
        self.silent = False
        self.reason = None
        logger.warning("%s is UP again: it spoke after %.1fs of silence", self.name, silent_s)
        if self._orphans:
            self.channel.send_nowait(AbortRequests(self._orphans))
            self._orphans = []

    def _fail_waiters(self, reason: str) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"{self.name} failed to start: {reason}"))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(StageDownError(self.stage_id, f"{self.name} is down: {reason}"))

    def _on_exit(self, description: str) -> None:
        if self.state == StageState.STARTING:
            # A worker whose build failed sends StageInitFailed (the traceback) and then exits:
            # the exit can be seen before the reader has the message. It gets a moment to arrive,
            # so the stage is named with the reason, not only its exit code.
            asyncio.get_running_loop().call_later(EXIT_WHILE_STARTING_GRACE_S, self._on_exit_now, description)
        else:
            self._on_exit_now(description)

    def _on_exit_now(self, description: str) -> None:
        if self.state != StageState.STOPPED:
            self.mark_down(description)  # a no-op when StageInitFailed already marked it down

    def _next_check(self, now: float) -> float:
        """Seconds until the next liveness deadline (the heartbeat timeout when none applies)."""
        heard = self._last_heard if self._last_heard is not None else self._started_at
        if self.state == StageState.UP and not self._sleep_controls:
            return heard + self.heartbeat_timeout_s - now
        if self.silent or (self.state == StageState.STARTING and self.heartbeats_from_start):
            return heard + HANG_FACTOR * self.heartbeat_timeout_s - now
        return self.heartbeat_timeout_s

    def _check_liveness(self, now: float) -> None:
        silent = now - (self._last_heard if self._last_heard is not None else self._started_at)
        if self.state == StageState.UP and silent >= self.heartbeat_timeout_s and not self._sleep_controls:
            self._fall_silent(silent)
        elif (self.silent or (self.state == StageState.STARTING and self.heartbeats_from_start)) \
                and silent >= HANG_FACTOR * self.heartbeat_timeout_s:
            since = "since it started" if self._last_heard is None else f"(deadline {self.heartbeat_timeout_s}s)"
            self.mark_down(f"no heartbeat for {silent:.1f}s {since}: hung, killed")

    async def _read_loop(self) -> None:
        while self.state != StageState.STOPPED:
            wait_ms = max(1, int(self._next_check(time.monotonic()) * 1000) + 1)
            msg = await self.channel.recv(wait_ms)
            now = time.monotonic()
            if msg is None:
                self._check_liveness(now)
                continue
            if self.silent:
                self._revive(now - (self._last_heard or now))
            self._last_heard = now
            self._dispatch(msg)

    def _reader_ended(self, task: asyncio.Task[None]) -> None:
        """Only close() ends the reader; if anything else does (a bug, a broken socket, a stray
        cancel), the stage is not listened to any more: DOWN, not a silent UP."""
        if self.state == StageState.STOPPED:
            return
        error = None if task.cancelled() else task.exception()
        if error is not None:
            logger.error("%s: its reader failed", self.name, exc_info=error)
        why = f"{type(error).__name__}: {error}" if error is not None else "it was cancelled"
        self.mark_down(f"its reader failed: {why}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, StageReady):
            self.info = msg.info
            self.pid = msg.pid  # the worker's own process: a Ray actor's is known only now
            if self.state == StageState.STARTING:
                self.state = StageState.UP
                assert self._ready is not None
                if not self._ready.done():
                    self._ready.set_result(None)
            logger.info("%s is UP (pid %d): %s", self.name, msg.pid, msgspec.structs.asdict(self.info))
        elif isinstance(msg, StageInitFailed):
            self.mark_down(f"initialization failed:\n{msg.error}")
        elif isinstance(msg, StageFatal):
            self.mark_down(f"worker loop failed:\n{msg.error}")
        elif isinstance(msg, (StageStats, SleepStatus)):
            fut = self._replies.get(msg.nonce)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            self._on_message(self.stage_id, msg)
