"""The orchestrator's process keeps to the cores its stage processes leave it while a pipeline
runs (engine/stage_launcher.py limit_own_torch_threads): with a torch thread per core, its small
parallel ops waited ~50 ms for threads the busy stages had displaced, at every hand-off between
stages (Qwen3-Omni first audio 206 -> 98-108 ms on the H200)."""
from __future__ import annotations

import asyncio
import os

import torch

from tests.e2e.conftest import short_params, user
from vllm_omni import Omni


def orchestrator_threads(omni: Omni) -> int:
    """torch's thread count in the orchestrator's own thread (OpenMP keeps it per thread)."""
    async def ask() -> int:
        return torch.get_num_threads()

    return asyncio.run_coroutine_threadsafe(ask(), omni._runtime._loop).result(timeout=10)


def test_the_orchestrator_uses_the_cores_the_stages_leave(omni_dir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # torch's own default: a thread per core
    try:
        # The thinker alone, one stage process (each more would import torch again for nothing
        # new: the count below follows the number of stage processes).
        with Omni(model=str(omni_dir), output_modalities=["text"]) as omni:
            processes = len(omni.stage_health())
            assert processes == 1 and omni.stage_health()[0].pid != os.getpid()
            per_stage = max(1, (cores - 1) // processes)
            assert orchestrator_threads(omni) == max(1, cores - processes * per_stage)
            outputs = omni.generate([{"messages": user({"type": "text", "text": "Hi."})}],
                                    short_params(thinker=4)[:1], use_tqdm=False)
            assert outputs and all(o.request_output.finished for o in outputs)
    finally:
        torch.set_num_threads(before)
