"""Rank 0's handle on the other rank processes of a tensor-parallel engine.

It spawns them, talks to them over one pipe each, and watches them from a thread: a rank that
exits marks the group dead at once, aborts the process group (a NCCL collective waiting on
the dead peer fails instead of hanging; gloo fails on the closed socket by itself) and kills
the remaining ranks, which could only wait on the dead one. Stopping (explicit, when the
engine is collected, or at interpreter exit) sends Shutdown and reaps every rank within a
deadline.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait

from vllm_omni.core.child_processes import terminate_alive_proc
from vllm_omni.core.tp_protocol import RankFailed, Shutdown
from vllm_omni.core.tp_worker import RankSpec, receive, send, tp_rank_main
from vllm_omni.model_executor.parallel_state import TPGroup

logger = logging.getLogger(__name__)

_WATCH_S = 1.0  # the watcher re-checks for shutdown this often
_STOP_TIMEOUT_S = 5.0


class TensorParallelError(RuntimeError):
    """The engine's tensor-parallel group is broken (a rank died, or the ranks fell out of
    step): it can run no more steps."""


class GroupHealth:
    """Shared by rank 0's threads: why the group is dead (None while it is not)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.closing = threading.Event()
        self.group: TPGroup | None = None  # set once rank 0 has joined it

    def fail(self, reason: str, procs: list[mp.process.BaseProcess]) -> None:
        with self._lock:
            if self.reason is not None or self.closing.is_set():
                return
            self.reason = reason
        logger.error("tensor-parallel group failed: %s", reason)
        if self.group is not None:
            self.group.abort()
        for proc in procs:
            proc.kill()  # a no-op for one that is gone; reaping is the watcher's job


class RankProcesses:
    """Ranks 1..N-1; `procs[i]` / `conns[i]` belong to rank i + 1."""

    def __init__(self, specs: list[RankSpec]) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.health = GroupHealth()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._reports: list[str] = []  # RankFailed tracebacks received so far
        # Only the watcher reaps the ranks (two threads waiting on one pid race each other).
        self._watcher = threading.Thread(target=_watch, args=(self.procs, self.health), name="tp-rank-watcher",
                                         daemon=True)
        self._stopper = weakref.finalize(self, _stop, self.procs, self.conns, self.health, self._watcher)
        for spec in specs:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=tp_rank_main, args=(spec, theirs), daemon=True,
                               name=f"vllm-omni-tp-rank{spec.rank}")
            proc.start()
            theirs.close()  # only the child holds its end: its death reads as EOF here
            self.procs.append(proc)
            self.conns.append(ours)
        self._watcher.start()

    def check(self) -> None:
        if self.health.reason is not None:
            raise TensorParallelError(self.failure())

    def fail(self, reason: str) -> TensorParallelError:
        self.health.fail(reason, self.procs)
        return TensorParallelError(self.failure())

    def failure(self) -> str:
        """Why the group failed, with the tracebacks ranks sent before exiting (read here, in
        the engine's thread: the only one that reads the pipes)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll():
                    msg = receive(conn)
                    if isinstance(msg, RankFailed):
                        self._reports.append(f"tensor-parallel rank {rank} failed:\n{msg.error}")
            except (EOFError, OSError):
                continue  # nothing more from that one
        return "\n".join([self.health.reason or "", *self._reports])

    def send_all(self, msg: object) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                send(conn, msg)
            except OSError as e:
                raise self.fail(f"cannot reach tensor-parallel rank {rank}: {e}") from e

    def collect(self, kind: type, timeout_s: float, what: str, step: int | None = None) -> dict[int, object]:
        """One `kind` message (of `step`, when given) from every rank within `timeout_s`.
        A rank that fails, exits or stays silent breaks the group: TensorParallelError."""
        deadline = time.monotonic() + timeout_s
        pending = {conn: rank for rank, conn in enumerate(self.conns, start=1)}
        got: dict[int, object] = {}
        while pending:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.fail(f"tensor-parallel rank(s) {sorted(pending.values())} did not {what} within "
                                f"{timeout_s:.0f}s")
            for conn in wait(list(pending), timeout=min(left, _WATCH_S)):
                rank = pending[conn]
                try:
                    msg = receive(conn)
                except (EOFError, OSError):
                    raise self.fail(f"tensor-parallel rank {rank} exited before it could {what}") from None
                if isinstance(msg, RankFailed):
                    self._reports.append(f"tensor-parallel rank {rank} failed:\n{msg.error}")
                    raise self.fail(f"tensor-parallel rank {rank} failed")
                if isinstance(msg, kind) and (step is None or msg.step == step):
                    got[rank] = msg
                    del pending[conn]
        return got

    def stop(self) -> None:
        self._stopper()


def _watch(procs: list[mp.process.BaseProcess], health: GroupHealth) -> None:
    alive = {proc.sentinel: (rank, proc) for rank, proc in enumerate(procs, start=1)}
    while alive and not health.closing.is_set():
        for sentinel in wait(list(alive), timeout=_WATCH_S):
            if health.closing.is_set():
                return  # a rank leaving on Shutdown; `_stop` reaps it
            rank, proc = alive.pop(sentinel)
            proc.join(_STOP_TIMEOUT_S)  # the sentinel fires a moment before the exit code is readable
            health.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}", procs)


def _stop(procs: list[mp.process.BaseProcess], conns: list[Connection], health: GroupHealth,
          watcher: threading.Thread) -> None:
    health.closing.set()
    for conn in conns:
        try:
            send(conn, Shutdown())
        except OSError:
            pass  # that rank is gone already
    if watcher.is_alive() and watcher is not threading.current_thread():  # a finalizer runs in any thread
        watcher.join(2 * _WATCH_S)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        terminate_alive_proc(proc, _STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
