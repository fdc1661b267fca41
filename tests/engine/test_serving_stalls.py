"""Serving processes freeze their start-up heap and log long garbage collections (serving_stalls.py)."""
from __future__ import annotations

import gc
import logging

from vllm_omni.engine.serving_stalls import freeze_startup_heap, log_long_pauses


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
