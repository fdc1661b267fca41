"""Where a stage process's time goes: its loop under the torch profiler (off unless asked).

    VLLM_OMNI_PROFILE_DIR=DIR VLLM_OMNI_PROFILE_STAGES=1[,2] [VLLM_OMNI_PROFILE_SKIP=50] \
        [VLLM_OMNI_PROFILE_STEPS=200] python benchmarks/bench_omni_e2e.py ...

Each named stage profiles its loop from its SKIP-th engine step for STEPS steps (stage
processes inherit the variables; `VLLM_OMNI_PROFILE_SKIP=0:300,1:20` skips per stage), then
writes DIR/stage<N>-profile.txt: wall time per step, split into the engine step with its
output send (model, scheduling, per-request Python, IPC encode) and the rest of the loop
(receiving and handling messages), the top ops by self CPU time and by self GPU time, and a
timeline of the steps (start, duration and outputs sent: a request's prefill, its first frame,
a waiting gap, the batch) on `time.perf_counter()`, one clock for every process of the host. A
stage that stops earlier writes what it has, if its shutdown leaves it the time (the torch
profiler's tables of many steps take seconds).
VLLM_OMNI_PROFILE_OPS=0 keeps the timeline only (no torch profiler, which slows what it
watches). VLLM_OMNI_PROFILE_PYTHON=1 runs cProfile over the same steps and adds its top
functions by own time and by cumulative time: which Python code a step's host time goes to.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import vllm_omni.envs as envs

logger = logging.getLogger(__name__)

ROWS = 30


class StepProfiler:
    def __init__(self, stage_id: int) -> None:
        self.stage_id = stage_id
        self.out_dir = envs.PROFILE_DIR.get()
        stages = {s.strip() for s in envs.PROFILE_STAGES.get().split(",")}
        self.enabled = bool(self.out_dir) and str(stage_id) in stages
        self.skip = _stage_skip(envs.PROFILE_SKIP.get(), stage_id)
        self.steps = envs.PROFILE_STEPS.get()
        self.ops = envs.PROFILE_OPS.get()
        self.python = envs.PROFILE_PYTHON.get()
        self._cprofile = None
        self.count = 0
        self._running = False
        self._prof = None
        self._started = 0.0
        self._in_step = 0.0
        self._timeline: list[tuple[float, float, int]] = []  # (start, duration, outputs) of each profiled step
        self._outputs = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step and the send of its outputs."""
        if not self.enabled:
            yield
            return
        if self.count == self.skip:
            self._start()
        began, self._outputs = time.perf_counter(), 0
        try:
            yield
        finally:
            self.count += 1
            if self._running:
                took = time.perf_counter() - began
                self._in_step += took
                self._timeline.append((began - self._started, took, self._outputs))
                if self.count == self.skip + self.steps:
                    self.close()

    def record_outputs(self, count: int) -> None:
        """How many outputs the current step sent (its rows, for a stage that streams every row)."""
        self._outputs = count

    def _start(self) -> None:
        import torch

        if self.ops:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        if self.python:
            import cProfile

            self._cprofile = cProfile.Profile()
            self._cprofile.enable()
        self._running = True
        self._started = time.perf_counter()

    def close(self) -> None:
        """Write the profile of the steps so far (at the last profiled step, or when the stage stops)."""
        if not self._running:
            return
        import torch

        self._running = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        n = max(1, len(self._timeline))
        lines = [f"stage {self.stage_id}: steps {self.skip}..{self.skip + n - 1}",
                 f"wall per step: {1e3 * wall / n:.3f} ms, of which engine step + output send "
                 f"{1e3 * self._in_step / n:.3f} ms, rest of the loop {1e3 * (wall - self._in_step) / n:.3f} ms"]
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            averages = prof.key_averages()
            lines += ["", "top ops by self CPU time:", averages.table(sort_by="self_cpu_time_total", row_limit=ROWS)]
            if torch.cuda.is_available():
                lines += ["", "top ops by self GPU time:",
                          averages.table(sort_by="self_device_time_total", row_limit=ROWS)]
        if self._cprofile is not None:
            self._cprofile.disable()
            lines += ["", _python_profile(self._cprofile)]
            self._cprofile = None
        # perf_counter is CLOCK_MONOTONIC on Linux: the stage processes' timelines line up.
        lines += ["", f"first profiled step at time.perf_counter() = {self._started:.6f} s",
                  "timeline (ms from the first profiled step: start +duration, outputs sent):"]
        lines += [f"  step {self.skip + i}: {1e3 * start:.2f} +{1e3 * took:.2f} ({outputs})"
                  for i, (start, took, outputs) in enumerate(self._timeline)]
        path = Path(self.out_dir) / f"stage{self.stage_id}-profile.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        logger.info("stage %d: profile of %d steps written to %s", self.stage_id, n, path)


def _python_profile(cprofile) -> str:
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(cprofile, stream=text)
    for order in ("tottime", "cumulative"):
        text.write(f"python functions by {order}:\n")
        stats.sort_stats(order).print_stats(ROWS)
    return text.getvalue()


def _stage_skip(value: str, stage_id: int) -> int:
    """"50" for every stage, or "0:300,1:20" per stage (50 for a stage not named)."""
    if ":" not in value:
        return int(value)
    per_stage = dict(item.split(":") for item in value.split(","))
    return int(per_stage.get(str(stage_id), "50"))
