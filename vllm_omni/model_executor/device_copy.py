"""Copies between host and device that never make the host wait for unrelated GPU work."""
from __future__ import annotations

import numpy as np
import torch


def to_device_nowait(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. On CUDA a copy from pageable host memory first waits for all work queued
    on the stream (a step's forward); from pinned memory it is only queued."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PinnedStaging:
    """Pinned host buffers for a step's queued host-to-device input copies, used in turn.

    The host fills the next step's inputs while the copy of the step before may still wait in
    the stream (async scheduling; or a run of prefill steps that sample nothing, which never
    wait). A buffer is refilled only once its last copy has run (`queued` records it): usually
    long done, as the host has read the tokens of a later step by then."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, count: int = 2) -> None:
        self._buffers = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(count)]
        self._arrays = [b.numpy() for b in self._buffers]  # rows filled through numpy: ~1 us a row
        self._copied: list[torch.cuda.Event | None] = [None] * count
        self._turn = 0

    def next(self) -> tuple[torch.Tensor, np.ndarray]:
        """The next buffer, as a tensor (the copy's source) and a numpy view of it (to fill)."""
        self._turn = (self._turn + 1) % len(self._buffers)
        event, self._copied[self._turn] = self._copied[self._turn], None
        if event is not None:
            event.synchronize()
        return self._buffers[self._turn], self._arrays[self._turn]

    def queued(self) -> None:
        """The copies from the buffer `next` returned are queued on the current stream."""
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event


class HostCopy:
    """A device tensor's copy to pinned host memory, queued behind the work that made it:
    `get()` waits for that copy alone, not for work queued after it (the next step's forward,
    under async scheduling). On the CPU the tensor itself."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
