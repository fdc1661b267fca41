"""`enable_diffusion_pipeline_profiler`: per-request seconds of a diffusion pipeline's phases.

The durations go out with the request's finished output (`StageOutput.stage_durations`) under
upstream vLLM-Omni's names, prefixed with the pipeline class:

- `<Pipeline>.text_encoder.forward`: preparing the request: prompt (and negative prompt) encoding,
  an edit's input image encoding, the seeded noise and the schedule;
- `<Pipeline>.diffuse`: the denoising steps the request took part in (a step shared by a batch
  counts whole for each of its requests);
- `<Pipeline>.vae.decode`: decoding its latents (one call for the requests finishing together);
- `<Pipeline>.__call__`: the diffusers adapter's whole pipeline call (it has no phases of ours).

Each phase is timed between two device synchronizations, so a phase's GPU work is counted in it;
the synchronizations exist only with the profiler on.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch

ENCODE, DIFFUSE, DECODE, CALL = "text_encoder.forward", "diffuse", "vae.decode", "__call__"


class PipelineProfiler:
    def __init__(self, pipeline: str, device: str) -> None:
        self.pipeline = pipeline
        self.cuda = torch.device(device).type == "cuda"
        self._durations: dict[str, dict[str, float]] = {}  # request id -> name -> seconds

    @contextlib.contextmanager
    def phase(self, phase: str, request_ids: Iterable[str]) -> Iterator[None]:
        """Time the block and add it to `phase` of each request."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            seconds = time.perf_counter() - start
            name = f"{self.pipeline}.{phase}"
            for rid in request_ids:
                durations = self._durations.setdefault(rid, {})
                durations[name] = durations.get(name, 0.0) + seconds

    def pop(self, request_id: str) -> dict[str, float] | None:
        """The request's durations (it finished, failed or left); None if nothing was timed."""
        return self._durations.pop(request_id, None)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def timed(profiler: PipelineProfiler | None, phase: str, request_ids: Iterable[str]) -> contextlib.AbstractContextManager:
    """`profiler.phase(...)`, or nothing at all when the profiler is off."""
    return profiler.phase(phase, request_ids) if profiler is not None else contextlib.nullcontext()
