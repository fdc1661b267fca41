"""Where the host waits for the GPU: every synchronising CUDA call a piece of code makes, with
the Python stack that made it (torch.cuda.set_sync_debug_mode). Used by the GPU tests that
keep a path free of waits and by benchmarks/bench_tts_first_frame.py --profile."""
from __future__ import annotations

import collections
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

OWN_CODE = ("vllm_omni", "benchmarks", "tests")


def trace_syncs(run: Callable[[], object]) -> list[tuple[int, str]]:
    """(count, stack) of every synchronising CUDA call made by `run()`, most frequent first;
    stacks keep our own frames (vllm_omni/, benchmarks/, tests/) only."""
    stacks: collections.Counter[str] = collections.Counter()
    recording = False

    def record(message, category, filename, lineno, file=None, line=None):
        # Only sync warnings, and not one the switch itself reports (it can flush a pending one).
        if not recording or "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(part in f.filename for part in OWN_CODE)]
        stacks["\n".join(f"    {Path(f.filename).name}:{f.lineno} {f.name}: {f.line}" for f in frames[-6:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        recording = True
        try:
            run()
        finally:
            recording = False
            torch.cuda.set_sync_debug_mode("default")
    return [(n, stack) for stack, n in stacks.most_common()]


def format_syncs(syncs: list[tuple[int, str]]) -> str:
    return "\n".join([f"synchronising calls: {sum(n for n, _ in syncs)}"] + [f"  x{n}\n{stack}" for n, stack in syncs])
