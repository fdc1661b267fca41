"""Admission control: a bounded number of requests in the pipeline, a bounded queue before it.

    gate = AdmissionGate(max_running=64, max_queued=256, wait_timeout_s=10)
    ticket = await gate.admit()      # APIError(429) when the queue is full or the wait expires
    try: ...  finally: ticket.release()

Overload is answered at once with 429 instead of growing an unbounded backlog in the stages;
requests already admitted are unaffected, so the server keeps serving.
"""
from __future__ import annotations

import asyncio

from vllm_omni.entrypoints.openai.errors import APIError


class Ticket:
    """One admitted request's slot; release() is idempotent (streams release on any exit path)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate._release()


class AdmissionGate:
    def __init__(self, max_running: int, max_queued: int, wait_timeout_s: float) -> None:
        if max_running < 1 or max_queued < 0 or wait_timeout_s < 0:
            raise ValueError(f"admission limits must be max_running >= 1, max_queued >= 0, wait >= 0; got "
                             f"{max_running}, {max_queued}, {wait_timeout_s}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.wait_timeout_s = wait_timeout_s
        self.running = 0
        self.queued = 0
        self._free = asyncio.Condition()

    async def admit(self) -> Ticket:
        if self.running < self.max_running and self.queued == 0:  # nobody ahead: no wait
            self.running += 1
            return Ticket(self)
        if self.queued >= self.max_queued:
            raise APIError(429, f"the server is at its limit ({self.running} requests running, {self.queued} "
                                "queued); retry later")
        self.queued += 1
        try:
            async with self._free:
                await asyncio.wait_for(self._free.wait_for(lambda: self.running < self.max_running),
                                       self.wait_timeout_s)
                self.running += 1
        except asyncio.TimeoutError:
            raise APIError(429, f"no free slot within {self.wait_timeout_s} s ({self.running} requests "
                                "running); retry later") from None
        finally:
            self.queued -= 1
        return Ticket(self)

    def _release(self) -> None:
        self.running -= 1
        # notify() needs the lock; a task keeps release synchronous for finally blocks and callbacks.
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._free:
            # All waiters re-check the predicate; one that timed out cannot swallow the wake-up.
            self._free.notify_all()
