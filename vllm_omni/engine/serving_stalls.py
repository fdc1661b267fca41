"""What stalls a serving process now and then: garbage collections and kernel compiles.

A stage process (and the API server's) holds hundreds of thousands of objects after start-up:
modules, the model's parameters and their Python wrappers, configs, tokenizers. A full
(generation 2) collection walks all of them, and it runs every so often whatever the load: on a
loaded host, tens to hundreds of milliseconds during which the stage does not step, i.e. one
request now and then waits that much longer for its first audio (issue 44: one Qwen3-Omni request
in eight at one in flight). `freeze_startup_heap` moves everything alive after start-up to the
permanent generation (vLLM does the same), so later collections walk only what serving makes:
the stage processes and `vllm-omni serve`'s process do it once they are up (not a library
caller's process, whose later garbage cycles it would keep).
`log_long_pauses` reports each collection over `threshold_s` (WARNING), so a benchmark's log
shows whether a slow request met one.

A Triton kernel meets a new specialization (a new shape's constexprs, a length's divisibility)
only while serving and compiles then, on the stage's host thread: 0.1-1 s during which nothing
of that stage steps (docs/benchmarks.md, rounds 11 and 19). With VLLM_OMNI_LOG_COMPILES=1 a stage
logs every kernel it compiles (or loads from Triton's disk cache) after start-up, with how long
it took (`log_kernel_compiles`), for a GPU run to say which request met which compile.

A step that never returns (a wait on the device, a lock) stalls the whole pipeline while the
stage's heartbeats go on, and so does an orchestrator loop that stops turning: `StepWatch` logs
every thread's stack when either has not moved for a minute.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import traceback

import vllm_omni.envs as envs

logger = logging.getLogger(__name__)

LONG_PAUSE_S = 0.02


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()


def log_long_pauses(where: str, threshold_s: float = LONG_PAUSE_S) -> None:
    """Install (once per process) a gc callback that logs collections longer than `threshold_s`."""
    if any(getattr(cb, "_vllm_omni_pause_log", False) for cb in gc.callbacks):
        return
    started = [0.0]

    def on_gc(phase: str, gc_stats: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= threshold_s:
            logger.warning("%s: a garbage collection of generation %d took %.1f ms (%d objects collected)",
                           where, gc_stats.get("generation", -1), 1000 * took, gc_stats.get("collected", 0))

    on_gc._vllm_omni_pause_log = True  # type: ignore[attr-defined]
    gc.callbacks.append(on_gc)


COMPILES_ENV = envs.LOG_COMPILES.name


def log_kernel_compiles(where: str) -> None:
    """With VLLM_OMNI_LOG_COMPILES=1 and Triton present: log each kernel compiled from now on."""
    if not envs.LOG_COMPILES.get():
        return
    try:
        from triton import knobs
    except ImportError:
        return
    started: dict[str, float] = {}

    def before(*, key, repr, already_compiled=False, **_: object) -> bool:  # noqa: A002 - Triton's names
        started[str(key)] = time.perf_counter()
        return False  # False: compile (True would skip the launch)

    def after(*, key, repr, already_compiled=False, **_: object) -> None:  # noqa: A002
        took = time.perf_counter() - started.pop(str(key), time.perf_counter())
        how = "loaded from the disk cache" if already_compiled else "compiled"
        logger.warning("%s: Triton kernel %s %s while serving in %.1f ms", where, repr, how, 1000 * took)

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


STUCK_STEP_S = 60.0  # a stage step that has not returned after this long is reported with every stack


class StepWatch:
    """Reports a loop that stops moving: after `stuck_s` the log gets every thread's stack, once
    per stall (a stalled pipeline then says which process, and where: a wait on the device, a
    lock, a blocking call). A stage loop sets `started` when a step begins and None when it
    returns; an event loop sets it to now on a timer (the watch then reports a loop that has not
    turned for `stuck_s`). An attribute write: nothing on the hot path; a daemon thread looks
    every `check_s`."""

    def __init__(self, where: str, stuck_s: float = STUCK_STEP_S, check_s: float = 5.0) -> None:
        self.where, self.stuck_s, self.check_s = where, stuck_s, check_s
        self.started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{where}-step-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        reported = None
        while not self._stop.wait(self.check_s):
            started = self.started
            if started is not None and started != reported and time.monotonic() - started >= self.stuck_s:
                reported = started
                names = {t.ident: t.name for t in threading.enumerate()}
                stacks = "".join(f"\n--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
                                 for ident, frame in sys._current_frames().items())
                logger.error("%s: stuck for %.0f s (a step that has not returned, a loop that has not turned); "
                             "every thread's stack:%s", self.where, time.monotonic() - started, stacks)
