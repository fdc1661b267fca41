"""Serving processes freeze their start-up heap, log long garbage collections and steps that do not
return (serving_stalls.py)."""
from __future__ import annotations

import gc
import logging
import time

from vllm_omni.engine.serving_stalls import StepWatch, freeze_startup_heap, log_long_pauses


def test_a_long_collection_is_logged_and_a_frozen_heap_is_not_walked_again(caplog):
    callbacks = list(gc.callbacks)
    try:
        log_long_pauses("stage 9", threshold_s=0.0)
        log_long_pauses("stage 9", threshold_s=0.0)  # once per process
        assert len(gc.callbacks) == len(callbacks) + 1
        with caplog.at_level(logging.WARNING, logger="vllm_omni.engine.serving_stalls"):
            gc.collect()
        assert any("stage 9: a garbage collection of generation 2 took" in r.getMessage() for r in caplog.records)
        objects = [[i] for i in range(20_000)]  # what start-up leaves behind
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(objects)
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks


def test_a_step_that_does_not_return_is_logged_once_with_every_threads_stack(caplog):
    caplog.set_level(logging.ERROR, logger="vllm_omni.engine.serving_stalls")
    watch = StepWatch("stage 7", stuck_s=0.05, check_s=0.01)
    try:
        watch.started = time.monotonic()  # a step starts and does not return ...
        time.sleep(0.3)
        stuck = [r.getMessage() for r in caplog.records]
        # ... once, naming the stage and where each thread is (this test's sleep among them)
        assert len(stuck) == 1 and stuck[0].startswith("stage 7: stuck for")
        assert "test_a_step_that_does_not_return" in stuck[0] and "stage 7-step-watch" in stuck[0]
        watch.started = None  # steps that return in time are not reported
        watch.started = time.monotonic()
        watch.started = None
        time.sleep(0.1)
        assert len(caplog.records) == 1
    finally:
        watch.close()
