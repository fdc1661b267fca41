"""Where a streaming generation stage runs its decode calls: now, or launched and collected later.

A code2wav stage decodes two kinds of chunks: a new stream's first chunk (its first audio, a
few frames, urgent) and the later chunks of streams already playing (seconds of audio each,
due only when the audio before them has played). On one CUDA context a call of later chunks
that is already on the GPU would hold a first chunk back for its whole length (tens of ms).
`CudaLanes` runs the later chunks on a low-priority CUDA stream, launched and collected by a
later step (`Launched.done()` polls an event, nothing waits), and a first chunk on a
high-priority stream at once: its kernels go ahead of the queued later ones.

`HostLanes` is the plain order (CPU, or a model that cannot overlap two calls): every call
finishes before the next begins, and a launched call is done at once.

A call returns one dict of tensors per stream, on any device; results come back on the host.
All of the stage's GPU work after loading runs on these two streams, so neither waits for the
other; what one call writes the other must not touch (the model's promise, see
`decode_lanes`), and the caching allocator keeps each stream's freed memory to that stream.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

import vllm_omni.envs as envs
from vllm_omni.model_executor.models.generation_model import GenerationModel, Results


class Launched:
    """A call's results on their way to the host (ready when `done()`)."""

    def __init__(self, results: Results, keep_alive: object = None, event: torch.cuda.Event | None = None) -> None:
        """`event`: marks the end of the copies into `results` (views of a staging buffer) and of
        the work on `keep_alive` (the device results); None: `results` are ready and their own."""
        self._results = results
        self._keep_alive = keep_alive
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def results(self) -> Results:
        if not self.done():
            raise RuntimeError("the launched decode has not finished")
        if self._event is None:
            return self._results
        self._keep_alive = None
        # The staging buffer is the next call's: the results get memory of their own.
        return [{k: v.clone() for k, v in r.items()} for r in self._results]


class HostLanes:
    overlapping = False

    def run_now(self, call: Callable[[], Results]) -> Results:
        return [{k: v.cpu() for k, v in r.items()} for r in call()]

    def launch(self, call: Callable[[], Results]) -> Launched:
        return Launched(self.run_now(call))


class CudaLanes:
    overlapping = True

    def __init__(self, device: torch.device) -> None:
        least, greatest = torch.cuda.Stream.priority_range()  # (low, high): greater priority is a smaller number
        self.urgent = torch.cuda.Stream(device, priority=greatest)
        self.background = torch.cuda.Stream(device, priority=least)
        # Results come back through pinned buffers of each lane's own, allocated now: allocating
        # pinned memory (or copying into pageable memory) may wait for the whole device.
        self._urgent_staging = _PinnedStaging()
        self._background_staging = _PinnedStaging()

    def run_now(self, call: Callable[[], Results]) -> Results:
        with torch.cuda.stream(self.urgent):
            host = self._urgent_staging.copy(call())
        self.urgent.synchronize()  # this stream only, not the later chunks on the other one
        return [{k: v.clone() for k, v in r.items()} for r in host]

    def launch(self, call: Callable[[], Results]) -> Launched:
        with torch.cuda.stream(self.background):
            device_results = call()
            host = self._background_staging.copy(device_results)
            event = torch.cuda.Event()
            event.record(self.background)
        return Launched(host, device_results, event)


class _PinnedStaging:
    """One pinned host buffer that a lane's results are copied into (asynchronously, on the
    lane's stream), reused by its next call; grown (rarely: a device-wide wait) when too small."""

    ALIGN = 64

    def __init__(self, nbytes: int = 8 << 20) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, results: Results) -> Results:
        sizes = [-(-v.numel() * v.element_size() // self.ALIGN) * self.ALIGN
                 for r in results for v in r.values() if v.is_cuda]
        if sum(sizes) > self.buffer.numel():
            self.buffer = torch.empty(2 * sum(sizes), dtype=torch.uint8, pin_memory=True)
        host, offset = [], 0
        for r in results:
            out = {}
            for k, v in r.items():
                if v.is_cuda:
                    nbytes = v.numel() * v.element_size()
                    view = self.buffer[offset: offset + nbytes].view(v.dtype).view(v.shape)
                    out[k] = view.copy_(v, non_blocking=True)
                    offset += -(-nbytes // self.ALIGN) * self.ALIGN
                else:
                    out[k] = v
            host.append(out)
        return host


def decode_lanes(device: str, model: GenerationModel) -> HostLanes | CudaLanes:
    """CUDA lanes for a model on a GPU that lets a first-chunk call overlap a later-chunk call
    (`overlaps_first_chunks`: it keeps their buffers, e.g. CUDA graph pools, apart)."""
    if not envs.DECODE_LANES.get():  # every decode in order on one stream (A/B runs)
        return HostLanes()
    if model.overlaps_first_chunks and device.startswith("cuda") and torch.cuda.is_available():
        return CudaLanes(torch.device(device))
    return HostLanes()
