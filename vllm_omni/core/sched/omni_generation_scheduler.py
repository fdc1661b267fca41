"""FIFO batching for non-autoregressive (generation) stages, e.g. code2wav.

A generation request needs exactly one forward pass, so scheduling is only "take the
oldest requests, up to max_batch_size". The documented name comes from spec 000
(`scheduler_cls: vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from vllm_omni.stage_io import StageRequest


class OmniGenerationScheduler:
    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} is invalid: must be >= 1")
        self.max_batch_size = max_batch_size
        # Insertion order is arrival order; a dict gives O(1) aborts by id.
        self._waiting: OrderedDict[str, StageRequest] = OrderedDict()

    def add_request(self, request: StageRequest) -> None:
        if request.request_id in self._waiting:
            raise ValueError(f"request {request.request_id} is already queued in this stage")
        self._waiting[request.request_id] = request

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Drop queued requests; returns the ids that were queued."""
        return [rid for rid in request_ids if self._waiting.pop(rid, None) is not None]

    def schedule(self) -> list[StageRequest]:
        """The next batch, oldest first; they leave the queue (one pass finishes them)."""
        batch = []
        while self._waiting and len(batch) < self.max_batch_size:
            batch.append(self._waiting.popitem(last=False)[1])
        return batch

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting)
