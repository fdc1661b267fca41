"""Admission control: a bounded number of prompts in the pipeline, a bounded queue before it.

    gate = AdmissionGate(max_running=64, max_queued=256, wait_timeout_s=10)
    ticket = await gate.admit(num_prompts)   # APIError(429) when the queue is full or the wait expires
    try: ...  finally: ticket.release()

The unit is a prompt, not an HTTP request: a completions request with 8 prompts runs 8
requests in the stages and takes 8 slots (a batch larger than the gate takes all of it).
Waiters are admitted first come, first served, so a large request is not starved by a stream
of small ones (and cannot jump ahead of them).
Overload is answered at once with 429 instead of growing an unbounded backlog in the stages;
requests already admitted are unaffected, so the server keeps serving.
"""
from __future__ import annotations

import asyncio
from collections import deque

from vllm_omni.entrypoints.openai.errors import APIError


class Ticket:
    """One admitted request's slots; release() is idempotent (streams release on any exit path)."""

    def __init__(self, gate: AdmissionGate, slots: int) -> None:
        self._gate: AdmissionGate | None = gate
        self.slots = slots

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate._release(self.slots)


class AdmissionGate:
    def __init__(self, max_running: int, max_queued: int, wait_timeout_s: float) -> None:
        if max_running < 1 or max_queued < 0 or wait_timeout_s < 0:
            raise ValueError(f"admission limits must be max_running >= 1, max_queued >= 0, wait >= 0; got "
                             f"{max_running}, {max_queued}, {wait_timeout_s}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.wait_timeout_s = wait_timeout_s
        self.running = 0  # prompts admitted and not yet released
        self.queued = 0  # prompts waiting
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.closed = False  # set on shutdown: nothing new is admitted
        self._idle = asyncio.Event()  # set while nothing is running
        self._idle.set()

    async def admit(self, slots: int = 1) -> Ticket:
        if self.closed:
            raise APIError(503, "the server is shutting down")
        if not 1 <= slots <= self.max_running:
            raise ValueError(f"a request takes 1 to {self.max_running} admission slots, not {slots}")
        if not self._waiters and self.running + slots <= self.max_running:  # nobody ahead: no wait
            self.running += slots
            self._idle.clear()
            return Ticket(self, slots)
        if self.queued + slots > self.max_queued:
            raise APIError(429, f"the server is at its limit ({self.running} prompts running, {self.queued} "
                                "queued); retry later")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (slots, turn)
        self._waiters.append(entry)
        self.queued += slots
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.wait_timeout_s)
        except asyncio.TimeoutError:
            pass  # admitted meanwhile or not: decided below
        except BaseException:  # cancelled: the client went away while queued
            self._leave(entry)
            raise
        finally:
            self.queued -= slots
        if not turn.done():
            self._leave(entry)
            raise APIError(429, f"no free slot within {self.wait_timeout_s} s ({self.running} prompts running); "
                                "retry later")
        if turn.exception() is not None:  # closed while waiting
            raise turn.exception()
        return Ticket(self, slots)

    def _leave(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A waiter gives up: out of the queue, or its slots back if it was admitted meanwhile."""
        slots, turn = entry
        if turn.done() and not turn.cancelled() and turn.exception() is None:
            self._release(slots)
            return
        if entry in self._waiters:
            self._waiters.remove(entry)
        turn.cancel()
        self._wake()  # a large waiter leaving the head may let the ones behind it in

    def close(self) -> None:
        """Stop admitting: every waiter gets 503 now, every later request too."""
        self.closed = True
        while self._waiters:
            _, turn = self._waiters.popleft()
            if not turn.done():
                turn.set_exception(APIError(503, "the server is shutting down"))

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no admitted request is running (True), at most `timeout_s` (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _release(self, slots: int) -> None:
        self.running -= slots
        self._wake()
        if self.running == 0:
            self._idle.set()

    def _wake(self) -> None:
        """Admit waiters in arrival order while the one at the head fits."""
        while self._waiters and self.running + self._waiters[0][0] <= self.max_running:
            slots, turn = self._waiters.popleft()
            self.running += slots
            self._idle.clear()
            turn.set_result(None)
