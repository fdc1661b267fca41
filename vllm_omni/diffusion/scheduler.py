"""Which requests denoise together: FCFS, at step boundaries, one batch key at a time.

The running batch holds requests whose inputs can share one denoiser forward (the model's
`batch_key`: image size, edit image size). At every step boundary the queue head joins while
it fits (`max_batch_size`) and matches the running key; the first request that does not match
stops admission, so later compatible requests never overtake it (no starvation), and it starts
once the running batch has drained. A request is prepared (prompt encoding, noise) only when
it reaches the head of the queue.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from vllm_omni.diffusion.request import DiffusionRequest


class DiffusionScheduler:
    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} is invalid: must be >= 1")
        self.max_batch_size = max_batch_size
        self.waiting: deque[DiffusionRequest] = deque()
        self.running: list[DiffusionRequest] = []

    def add(self, request: DiffusionRequest) -> None:
        self.waiting.append(request)

    def admit(self, prepare: Callable[[DiffusionRequest], bool]) -> None:
        """Move waiting requests into the running batch. `prepare` readies the head request and
        returns False when it failed (it is then dropped; the caller reports the error)."""
        while self.waiting and len(self.running) < self.max_batch_size:
            head = self.waiting[0]
            if not head.is_prepared and not prepare(head):
                self.waiting.popleft()
                continue
            if self.running and head.batch_key != self.running[0].batch_key:
                return
            self.running.append(self.waiting.popleft())

    def finish(self, requests: Sequence[DiffusionRequest]) -> None:
        done = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in done]

    def abort(self, request_ids: Sequence[str]) -> list[DiffusionRequest]:
        """Remove the requests wherever they are; their batch slots are free for the next step."""
        ids = set(request_ids)
        removed = [r for r in (*self.waiting, *self.running) if r.request_id in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        return removed

    def clear_running(self) -> list[DiffusionRequest]:
        running, self.running = self.running, []
        return running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
