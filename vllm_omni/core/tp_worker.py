"""The ranks of a tensor-parallel AR engine: what every rank builds, and ranks 1..N-1's loop.

Rank 0 is the engine itself (`tp_executor.TPExecutor`, in the stage process); it spawns one
process per other rank running `tp_rank_main`. Each rank builds its shard of the model, its
KV cache (the same number of blocks on every rank: the smallest any can afford) and an
`ARModelRunner`; the other ranks then run every step rank 0 plans (`tp_protocol`), joining
its collectives, and never sample.

Lifetime: a rank arms the parent-death signal, stays in the stage's process group (a stage
shutdown kills the group), exits when its pipe to rank 0 closes or its parent is gone, and
after a step of its own fails it waits at most `SETTLE_TIMEOUT_S` for rank 0 to follow up:
if rank 0 does not, it is stuck in a collective this rank will never join, and exiting is
what unblocks it (the dead peer fails the collective).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.core.child_processes import set_death_signal
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.kv_cache_sizing import KVCachePlan, plan_kv_cache
from vllm_omni.core.model_runner import ARModelRunner
from vllm_omni.core.tp_protocol import (
    Probe, RankFailed, RankReady, RankStarted, ShadowRequests, Shutdown, StepPlan, StepStatus,
)
from vllm_omni.model_executor.model_loader import load_model
from vllm_omni.model_executor.parallel_state import TPGroup, building_with, create_group, join_store

logger = logging.getLogger(__name__)

# Rendezvous, model loading and any one collective must finish within this.
TP_TIMEOUT_S = 600.0
# After a failed step, how long the ranks wait for each other before calling the group broken.
SETTLE_TIMEOUT_S = 60.0
_POLL_S = 1.0  # an idle rank re-checks its parent this often


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs; picklable (spawned children receive it)."""

    rank: int
    size: int
    store_port: int
    config: EngineConfig
    hf_config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    parent_pid: int
    torch_threads: int
    log_level: int


@dataclass
class RankEngine:
    model: nn.Module
    plan: KVCachePlan
    runner: ARModelRunner


def build_rank(config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype, group: TPGroup) -> RankEngine:
    """This rank's model shard, KV cache and runner. Every rank calls it at the same time:
    KV sizing runs collectives (a profiling forward on CUDA, the block-count agreement)."""
    device = group.device
    with building_with(group):
        model = load_model(config.model, hf_config, dtype, device, config.architecture, config.model_stage,
                           config.load_format, dict(config.predictor_sampling))
    plan = plan_kv_cache(config, model, dtype, device)
    num_blocks = group.all_reduce_min(plan.num_blocks)
    if num_blocks != plan.num_blocks:
        plan = plan_kv_cache(dataclasses.replace(config, num_kv_blocks=num_blocks), model, dtype, device)
    runner = ARModelRunner(
        model,
        device=device,
        dtype=dtype,
        block_size=config.block_size,
        num_blocks=plan.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_model_len=plan.max_model_len,
        hidden_state_layers=config.hidden_state_layers,
        # Collectives inside captured CUDA graphs are not validated here: TP > 1 runs eagerly.
        enforce_eager=True,
        samples=group.rank == 0,
    )
    return RankEngine(model, plan, runner)


def send(conn: Connection, msg: object) -> None:
    # Plain pickle: tensors travel as bytes, not as shared-memory handles.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


def tp_rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of rank `spec.rank`'s process."""
    set_death_signal(signal.SIGKILL)
    if os.getppid() != spec.parent_pid:  # the stage died before the death signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the stage's to handle
    logging.basicConfig(level=spec.log_level, format=f"[tp rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.torch_threads)
    code = 1
    try:
        code = _run(spec, conn)
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails the engine with it
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        try:
            send(conn, RankFailed(spec.rank, traceback.format_exc()))
        except OSError:
            pass  # rank 0 is gone: nobody to tell
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: nothing is left to flush


def _run(spec: RankSpec, conn: Connection) -> int:
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    store = join_store(spec.store_port, spec.size, TP_TIMEOUT_S)
    send(conn, RankStarted(spec.rank))
    group = create_group(store, spec.rank, spec.size, spec.device, TP_TIMEOUT_S)
    rank = build_rank(spec.config, spec.hf_config, spec.dtype, group)
    send(conn, RankReady(spec.rank))
    return _serve(rank.runner, conn, spec)


def _serve(runner: ARModelRunner, conn: Connection, spec: RankSpec) -> int:
    shadow = ShadowRequests()
    last_step, last_error = 0, None
    follow_up_by: float | None = None  # set after a failed step
    while True:
        msg = _next_message(conn, spec.parent_pid, follow_up_by)
        if msg is None:
            return 1
        follow_up_by = None
        if isinstance(msg, Shutdown):
            return 0
        if isinstance(msg, Probe):
            send(conn, StepStatus(spec.rank, msg.step, last_error if last_step == msg.step else None))
        elif isinstance(msg, StepPlan):
            last_step, last_error = msg.step, None
            try:
                runner.execute(shadow.apply(msg))
            except Exception as e:  # noqa: BLE001 - rank 0 decides whether the group survives it
                logger.exception("step %d failed", msg.step)
                last_error = f"{type(e).__name__}: {e}"
                follow_up_by = time.monotonic() + SETTLE_TIMEOUT_S
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")


def _next_message(conn: Connection, parent_pid: int, deadline: float | None) -> object | None:
    """The next message from rank 0, or None when rank 0 is gone or missed `deadline`."""
    while True:
        wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if wait <= 0:
            logger.error("rank 0 did not follow up on a failed step within %ss; exiting", SETTLE_TIMEOUT_S)
            return None
        try:
            if conn.poll(wait):
                return receive(conn)
        except (EOFError, OSError):
            return None  # rank 0 closed its end: the engine is gone
        if os.getppid() != parent_pid:
            return None
