"""A stage worker whose chosen replicas are slow on purpose (load-balancing benchmark and tests).

    --stage-overrides '{"1": {"worker_cls": "vllm_omni.testing.slow_replica.SlowARWorker",
                              "env": {"VLLM_OMNI_SLOW_REPLICAS": "1", "VLLM_OMNI_SLOW_STEP_S": "0.05"}}}'

runs stage 1's AR engine as usual, except that replicas listed in VLLM_OMNI_SLOW_REPLICAS
(their VLLM_OMNI_REPLICA_ID, set by the orchestrator) sleep VLLM_OMNI_SLOW_STEP_S before
each engine step: a replica on a busier or slower device.
"""
from __future__ import annotations

import time

import vllm_omni.envs as envs
from vllm_omni.stage_io import StageOutput
from vllm_omni.worker.ar_stage_engine import ARStageEngine
from vllm_omni.worker.gpu_ar_worker import GPUARWorker


class SlowARWorker(GPUARWorker):
    def build_engine(self) -> ARStageEngine:
        engine = super().build_engine()
        if envs.REPLICA_ID.get() in envs.SLOW_REPLICAS.get().split(","):
            delay = envs.SLOW_STEP_S.get()
            step = engine.step

            def slow_step() -> list[StageOutput]:
                time.sleep(delay)
                return step()

            engine.step = slow_step  # type: ignore[method-assign]
        return engine
