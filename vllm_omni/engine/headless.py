"""`vllm-omni serve MODEL --headless --stage-id N ...`: run one stage's replicas for a head elsewhere.

The process starts `runtime.num_replicas` (`--omni-dp-size-local`) stage processes of stage N,
each exactly the worker a local stage runs (stage_worker.py) but with a tcp inbox, registering
itself with the head (registration.py). It restarts nothing: it lives while any of its replicas
does, and exits 0 when all stopped because the head told them to, 1 otherwise (the head went
away, refused them, or one crashed), so that a process manager may start it again. Ctrl-C or
SIGTERM stops the replicas (each says goodbye to the head) within the shutdown timeout.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import uuid

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.cluster_secret import CurveKeys, require_secret_to_listen
from vllm_omni.engine.registration import RemoteAttach, pipeline_fingerprint, pipeline_summary, routable_address, tcp
from vllm_omni.engine.replica_pool import replica_configs
from vllm_omni.engine.stage_init_utils import prepare_engine_environment
from vllm_omni.engine.stage_launcher import ProcessLauncher
from vllm_omni.engine.stage_worker import WorkerSpec
from vllm_omni.engine.transport import INLINE_ONLY
from vllm_omni.engine.transport_guard import DEFAULT_MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HeadlessOptions:
    stage_id: int
    master_address: str
    master_port: int
    replica_address: str | None = None  # None: this host's address on the route to the master
    stage_init_timeout_s: float = 300.0
    shutdown_timeout_s: float = 10.0
    keys: CurveKeys | None = dataclasses.field(default=None, repr=False)  # the cluster secret's
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def run_headless(pipeline: PipelineConfig, model: str, options: HeadlessOptions) -> int:
    """Serve stage `options.stage_id` until its replicas stop; the exit code (see the module doc)."""
    prepare_engine_environment()
    specs = worker_specs(pipeline, model, options)
    return asyncio.run(_supervise([ProcessLauncher(spec) for spec in specs], options))


def worker_specs(pipeline: PipelineConfig, model: str, options: HeadlessOptions) -> list[WorkerSpec]:
    stage = pipeline.stage(options.stage_id)
    summary = pipeline_summary(pipeline, model)
    attach = RemoteAttach(options.master_address, options.master_port, pipeline_fingerprint(summary), summary,
                          options.keys)
    bind = options.replica_address or routable_address(options.master_address)
    require_secret_to_listen(bind, options.keys, "--omni-replica-address, or the route to --omni-master-address")
    replicas = replica_configs(stage)
    # Only this stage's replicas share the host's cores here; one core stays with this process.
    threads = None if "OMP_NUM_THREADS" in os.environ else max(1, ((os.cpu_count() or 1) - 1) // len(replicas))
    return [WorkerSpec(stage=replica, model=model, in_addr=tcp(bind, "*"), out_addr="",  # the head says where
                       shm_threshold_bytes=INLINE_ONLY, shm_prefix=f"vomni-{os.getpid()}-{uuid.uuid4().hex[:6]}-",
                       max_message_bytes=options.max_message_bytes,
                       heartbeat_interval_s=1.0, stage_init_timeout_s=options.stage_init_timeout_s,
                       parent_pid=os.getpid(), in_process=False, torch_threads=threads,
                       log_level=logging.getLogger().getEffectiveLevel(), remote=attach)
            for replica in replicas]


async def _supervise(launchers: list[ProcessLauncher], options: HeadlessOptions) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    exited: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for replica, launcher in enumerate(launchers):
        launcher.start(on_exit=lambda how, r=replica: exited.put_nowait((r, how)))
    logger.info("stage %d: %d headless replica(s) started (pids %s), registering with the head at %s",
                options.stage_id, len(launchers), [launcher.pid for launcher in launchers],
                tcp(options.master_address, options.master_port))
    running = set(range(len(launchers)))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while running:
            next_exit = asyncio.ensure_future(exited.get())
            await asyncio.wait({next_exit, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not next_exit.done():
                next_exit.cancel()
                logger.info("stage %d: stopping its headless replicas", options.stage_id)
                await asyncio.gather(*(launchers[r].stop(options.shutdown_timeout_s, graceful=False)
                                       for r in running))
                return 0
            replica, how = next_exit.result()
            running.discard(replica)
            logger.log(logging.INFO if _code(launchers[replica]) == 0 else logging.ERROR,
                       "stage %d: headless replica %d %s", options.stage_id, replica, how)
    finally:
        stopping.cancel()
    return 0 if all(_code(launcher) == 0 for launcher in launchers) else 1


def _code(launcher: ProcessLauncher) -> int | None:
    return launcher.proc.exitcode if launcher.proc is not None else None
