"""Rank 0 of a tensor-parallel AR engine: where `ARModelRunner` stands at TP=1.

`LLMEngine` with `tensor_parallel_size = N > 1` builds a `TPExecutor` instead of a runner. It
starts ranks 1..N-1 (`tp_ranks`), joins them in one process group (gloo on CPU, NCCL on
CUDA; rank r uses the r-th device after the engine's), builds its own shard in lockstep with
theirs (`tp_worker.build_rank`), and then, each step, sends the step's plan (`tp_protocol`)
before running the same `execute` as the other ranks; only rank 0 samples.

Failures. A rank that exits fails the group at once (TensorParallelError on the step in
flight or the next call; `check_health` raises it between steps so an idle stage goes down
too). When rank 0's own step raises, it asks every rank whether it came out of that step
(`Probe`): if all did, the collectives still line up and the error is the step's own (a bad
request fails the step exactly as at TP=1 and the engine goes on); a rank that stays inside
the step is waiting on a collective rank 0 left, so the group is broken.
"""
from __future__ import annotations

import logging
import os

import torch
from transformers import PretrainedConfig

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.model_runner import RunnerOutput
from vllm_omni.core.scheduler import SchedulerOutput
from vllm_omni.core.tp_protocol import Probe, RankReady, RankStarted, StepPlanner, StepStatus
from vllm_omni.core.tp_ranks import RankProcesses, TensorParallelError
from vllm_omni.core.tp_worker import SETTLE_TIMEOUT_S, TP_TIMEOUT_S, RankSpec, build_rank
from vllm_omni.model_executor.models.registry import resolve_model_class
from vllm_omni.model_executor.models.stage_model import StageModel
from vllm_omni.model_executor.parallel_state import create_group, host_store

logger = logging.getLogger(__name__)

__all__ = ["TPExecutor", "TensorParallelError"]


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the CPU, or the r-th CUDA device from the engine's own."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor_parallel_size={size} needs cuda or cpu devices, not {device.type}")
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + size > visible:
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from cuda:{first}, but "
                         f"{visible} are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return [torch.device("cuda", first + r) for r in range(size)]


def check_supported(config: EngineConfig, hf_config: PretrainedConfig) -> None:
    architecture = config.architecture or (hf_config.architectures or [None])[0]
    if architecture is None:
        return  # load_model reports it
    model_cls = resolve_model_class(architecture, config.model_stage)
    if model_cls.on_tokens_sampled is not StageModel.on_tokens_sampled:
        # Its per-token step (e.g. a code predictor) runs after sampling, on rank 0 alone.
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: {model_cls.__name__} runs model "
                         "code after sampling (on_tokens_sampled), which is not supported with tensor parallelism")


class TPExecutor:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = config.tensor_parallel_size
        check_supported(config, hf_config)
        devices = rank_devices(device, size)
        self._store = host_store(size, TP_TIMEOUT_S)  # NCCL reads it again at its first collective
        specs = [RankSpec(rank, size, self._store.port, config, hf_config, dtype, devices[rank], os.getpid(),
                          max(1, torch.get_num_threads() // size), logging.getLogger().getEffectiveLevel())
                 for rank in range(1, size)]
        self.ranks = RankProcesses(specs)
        try:
            self.ranks.collect(RankStarted, TP_TIMEOUT_S, "start")
            if devices[0].type == "cuda":
                torch.cuda.set_device(devices[0])
            group = create_group(self._store, 0, size, devices[0], TP_TIMEOUT_S)
            self.ranks.health.group = group
            built = build_rank(config, hf_config, dtype, group)
            self.ranks.collect(RankReady, TP_TIMEOUT_S, "load its shard")
        except Exception as e:
            broken = self.ranks.health.reason is not None and not isinstance(e, TensorParallelError)
            failure = self.ranks.failure() if broken else ""
            self.ranks.stop()
            if broken:  # rank 0's error may be the symptom (a collective with a dead peer) or the same error
                raise TensorParallelError(f"{failure}\nrank 0: {type(e).__name__}: {e}") from e
            raise
        self.model, self.plan, self.runner = built.model, built.plan, built.runner
        self._planner = StepPlanner()
        self._step = 0
        logger.info("tensor parallel over %d ranks (%s), %s devices", size, "NCCL" if devices[0].type == "cuda"
                    else "gloo", [str(d) for d in devices])

    def check_health(self) -> None:
        self.ranks.check()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.ranks.check()
        self._step += 1
        self.ranks.send_all(self._planner.plan(self._step, sched))
        try:
            out = self.runner.execute(sched)
        except Exception as e:
            self._settle_failed_step(e)
            raise
        # A rank that died mid-step: an aborted NCCL collective returns, with garbage in its output.
        self.ranks.check()
        return out

    def _settle_failed_step(self, error: Exception) -> None:
        """Returns when every rank came out of the failed step; raises TensorParallelError otherwise."""
        if self.ranks.health.reason is not None:
            raise TensorParallelError(self.ranks.failure()) from error
        self.ranks.send_all(Probe(self._step))
        try:
            statuses = self.ranks.collect(StepStatus, SETTLE_TIMEOUT_S, f"finish step {self._step} after rank 0's "
                                          f"step failed ({type(error).__name__}: {error})", step=self._step)
        except TensorParallelError as broken:
            raise broken from error
        for rank, status in sorted(statuses.items()):
            if status.error is not None:
                logger.warning("tensor-parallel rank %d: step %d failed too: %s", rank, self._step, status.error)

    def close(self) -> None:
        """Stop the other ranks (also done when the executor is collected and at exit)."""
        self.ranks.stop()
