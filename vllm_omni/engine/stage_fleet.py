"""The stage fleet: every replica of every stage, from launch to shutdown.

It launches each stage's replicas (processes, threads or Ray actors; headless replicas register
through the `StageMaster` of the stage-based CLI), waits until all are UP, has the supervisor
restart a replica that went down (engine/supervisor.py), answers health, and stops everything
in pipeline order. What flows through the replicas (request state, routing, streaming edges) is
the orchestrator's: the fleet hands each replica's messages and its going DOWN to the callbacks
it was built with.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.load_balancer import make_policy
from vllm_omni.engine.replica_pool import ReplicaRef, StagePool, replica_configs
from vllm_omni.engine.stage_client import StageClient, StageHealth, StageState
from vllm_omni.engine.ray_cluster import RayCluster
from vllm_omni.engine.registration import pipeline_summary
from vllm_omni.engine.stage_launcher import (
    ProcessLauncher, StageLauncher, ThreadLauncher, limit_own_torch_threads, torch_threads_for,
)
from vllm_omni.engine.stage_master import MasterLimits, RemoteLauncher, StageMaster
from vllm_omni.engine.stage_worker import WorkerSpec
from vllm_omni.engine.supervisor import StageSupervisor
from vllm_omni.engine.transport import (
    LinkGuard, OrchestratorChannel, make_ipc_dir, stage_addresses, sweep_shared_memory,
)
from vllm_omni.engine.transport_guard import DropCounter, DropKey, ZapGuard

if TYPE_CHECKING:
    from vllm_omni.engine.orchestrator import RuntimeOptions

logger = logging.getLogger(__name__)

# (stage id, message, replica=) and (stage id, reason, replica=): the owner's handlers.
OnMessage = Callable[..., None]
OnDown = Callable[..., None]


class StageFleet:
    def __init__(self, pipeline: PipelineConfig, model: str, options: RuntimeOptions, on_message: OnMessage,
                 on_down: OnDown) -> None:
        self.pipeline = pipeline
        self.model = model
        self.options = options
        self.stages: dict[int, StageConfig] = {s.stage_id: s for s in pipeline.stages}
        self._on_message, self._on_down = on_message, on_down
        self._check_stage_cli()
        # Every replica's own stage config (its devices, its replica id), checked before anything starts.
        self._replica_stages = {s.stage_id: replica_configs(s) for s in pipeline.stages}
        self.pools = {s.stage_id: StagePool(s.stage_id, s.model_stage, self._local_replicas(s),
                                            make_policy(options.lb_policy)) for s in pipeline.stages}
        # Names every shared memory segment this pipeline creates, so close() can sweep leftovers.
        self._shm_prefix = f"vomni-{os.getpid()}-{uuid.uuid4().hex[:6]}-"
        self._ipc_dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._threads_before: int | None = None  # the orchestrator thread's torch threads before start()
        self.supervisor = StageSupervisor(self.restart_replica, options.max_stage_restarts)
        self._launches: Counter[ReplicaRef] = Counter()  # per replica: a restart gets fresh socket addresses
        self._down_reasons: dict[ReplicaRef, str] = {}  # why a replica last went down
        self._closing = False
        self._ray: RayCluster | None = None  # worker_backend "ray": the cluster the stage actors run on
        self._master: StageMaster | None = None  # the stage-based CLI's registration socket
        self._zap: ZapGuard | None = None  # lets in only peers with the cluster secret (the master's links)
        self.drops = DropCounter()  # what this process's stage links dropped (/metrics)

    def _check_stage_cli(self) -> None:
        local = self.options.local_stage
        if local is not None and local not in self.stages:
            raise ValueError(f"--stage-id {local}: the pipeline has no such stage (stages {sorted(self.stages)})")
        others = [sid for sid in self.stages if local is not None and sid != local]
        if others and self.options.master_address is None:
            raise ValueError(f"--stage-id {local} runs only stage {local} here; stages {others} must register as "
                             "headless stages, which needs --omni-master-address and --omni-master-port")

    def _local_replicas(self, stage: StageConfig) -> int:
        """Replicas this process launches: none of a stage that headless processes run."""
        local = self.options.local_stage
        return stage.runtime.num_replicas if local is None or local == stage.stage_id else 0

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Launch every stage at once and wait until all are UP; on any failure, stop them all."""
        self._ipc_dir = make_ipc_dir()
        self._ctx = zmq.Context()
        self._threads_before = limit_own_torch_threads(self.pipeline)
        t0 = time.monotonic()
        try:
            if self.options.worker_backend == "ray":
                self._ray = RayCluster.connect(self.options.ray_address, self.pipeline)
            if self.options.master_address is not None:
                if self.options.cluster_keys is not None:
                    self._zap = ZapGuard(self._ctx, self.options.cluster_keys)
                await self._start_master()
            for stage in self.pipeline.stages:
                for replica in range(self._local_replicas(stage)):
                    self._launch(stage, replica)
            opts = self.options
            stage_deadline, overall = t0 + opts.stage_init_timeout_s, t0 + opts.init_timeout_s
            what = (f"stage_init_timeout={opts.stage_init_timeout_s}s" if stage_deadline <= overall
                    else f"init_timeout={opts.init_timeout_s}s")
            waits = [asyncio.ensure_future(c.wait_ready(min(stage_deadline, overall), what))
                     for c in self.all_clients()]
            remote = [s.stage_id for s in self.pipeline.stages if not self._local_replicas(s)]
            if remote:
                assert self._master is not None
                waits.append(asyncio.ensure_future(self._master.wait_for_stages(
                    remote, overall, f"init_timeout={opts.init_timeout_s}s")))
            # The first stage that fails (or times out) fails the start: waiting for the others
            # to finish loading their models would only delay the error.
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            errors = [t.exception() for t in done if t.exception() is not None]
            if errors:
                kind = TimeoutError if any(isinstance(e, TimeoutError) for e in errors) else RuntimeError
                raise kind("pipeline failed to start: " + "; ".join(str(e) for e in errors))
        except BaseException:
            await self.close()
            raise
        logger.info("pipeline of %d stages is up in %.1fs", len(self.pools), time.monotonic() - t0)
        for stage in self.pipeline.stages:
            for replica in range(self._local_replicas(stage)):
                self.supervisor.started(self.pools[stage.stage_id].ref(replica), time.monotonic() - t0)

    def all_clients(self) -> list[StageClient]:
        """Every replica of every stage."""
        return [c for pool in self.pools.values() for c in pool.clients()]

    def _launch(self, stage: StageConfig, replica: int) -> StageClient:
        assert self._ipc_dir is not None and self._ctx is not None
        pool = self.pools[stage.stage_id]
        ref = pool.ref(replica)
        stage = self._replica_stages[stage.stage_id][replica]
        self._launches[ref] += 1
        # A restarted replica gets addresses of its own: the old sockets' files may still be
        # unlinked by their (asynchronous) close.
        ipc_dir = os.path.join(self._ipc_dir, f"replica{replica}-launch{self._launches[ref]}")
        os.makedirs(ipc_dir, exist_ok=True)
        in_addr, out_addr = stage_addresses(ipc_dir, stage.stage_id)
        # Each side of this launch names its shared memory segments with a prefix of its own, and
        # opens only segments named with the other's: nothing it is sent can name another's.
        launch_prefix = f"{self._shm_prefix}{stage.stage_id}r{replica}l{self._launches[ref]}"
        worker_prefix, orchestrator_prefix = f"{launch_prefix}w-", f"{launch_prefix}o-"
        opts = self.options
        spec = WorkerSpec(
            stage=stage, model=self.model, in_addr=in_addr, out_addr=out_addr,
            shm_threshold_bytes=opts.shm_threshold_bytes, shm_prefix=worker_prefix,
            peer_shm_prefix=orchestrator_prefix, max_message_bytes=opts.max_message_bytes,
            heartbeat_interval_s=min(opts.heartbeat_interval_s, opts.heartbeat_timeout_s / 4),
            stage_init_timeout_s=opts.stage_init_timeout_s,
            parent_pid=os.getpid(), in_process=not stage.runtime.process,
            torch_threads=torch_threads_for(stage, self.pipeline), log_level=logging.getLogger().getEffectiveLevel(),
        )
        launcher: StageLauncher
        if not stage.runtime.process:
            launcher = ThreadLauncher(spec)
        elif self._ray is not None:
            launcher = self._ray.launcher(spec)
        else:
            launcher = ProcessLauncher(spec)
        guard = LinkGuard(accept_shm_prefix=worker_prefix, max_message_bytes=opts.max_message_bytes,
                          counter=self.drops, stage=str(stage.stage_id))
        channel = OrchestratorChannel(self._ctx, in_addr, out_addr, opts.shm_threshold_bytes, orchestrator_prefix,
                                      guard)
        client = self._client(stage.stage_id, replica, launcher, channel, ref.name)
        client.start()
        return client

    def _client(self, stage_id: int, replica: int, launcher: StageLauncher, channel: OrchestratorChannel,
                name: str) -> StageClient:
        """A replica's client, wired to this orchestrator and put in its pool's slot (not started)."""
        client = StageClient(stage_id, self.stages[stage_id].model_stage, launcher, channel,
                             on_message=functools.partial(self._on_message, replica=replica),
                             on_down=functools.partial(self._replica_down, replica=replica),
                             heartbeat_timeout_s=self.options.heartbeat_timeout_s, name=name,
                             heartbeats_from_start=isinstance(launcher, RemoteLauncher))
        self.pools[stage_id].replicas[replica] = client
        return client

    async def _start_master(self) -> None:
        assert self._ctx is not None and self.options.master_address is not None
        opts = self.options
        summary = pipeline_summary(self.pipeline, self.model)

        def remote_client(stage_id: int, replica: int, launcher: StageLauncher,
                          channel: OrchestratorChannel) -> StageClient:
            return self._client(stage_id, replica, launcher, channel, f"{self.pools[stage_id].name} replica {replica}")

        limits = MasterLimits(keys=opts.cluster_keys, max_message_bytes=opts.max_message_bytes,
                              max_replicas_per_stage=opts.max_replicas_per_stage,
                              registration_rate=opts.registration_rate)
        self._master = StageMaster(
            self._ctx, opts.master_address, opts.master_port, self.model, summary, self.pools, remote_client,
            heartbeat_interval_s=min(opts.heartbeat_interval_s, opts.heartbeat_timeout_s / 4),
            heartbeat_timeout_s=opts.heartbeat_timeout_s, stage_init_timeout_s=opts.stage_init_timeout_s,
            limits=limits, drops=self.drops)
        await self._master.start()

    async def restart_replica(self, ref: ReplicaRef) -> None:
        """Replace a replica that went down with a fresh process (called by the supervisor);
        raises when the new one does not come up within stage_init_timeout."""
        pool = self.pools[ref.stage_id]
        old = pool.replicas[ref.replica]
        assert old is not None
        await old.close(self.options.shutdown_timeout_s)  # its process is already killed
        t0 = time.monotonic()
        client = self._launch(self.stages[ref.stage_id], ref.replica)
        limit = self.options.stage_init_timeout_s
        try:
            await client.wait_ready(t0 + limit, f"stage_init_timeout={limit}s")
        except TimeoutError as e:
            client.mark_down(str(e))  # kills what is left of it
            raise
        self.supervisor.started(ref, time.monotonic() - t0)

    async def close(self) -> None:
        """Stop every replica (in pipeline order), then what they ran on; no more restarts."""
        self._closing = True
        await self.supervisor.close()
        # In pipeline order: nothing flows into a stage after its sources have stopped.
        for sid in self.pipeline.topo_order():
            await asyncio.gather(*(c.close(self.options.shutdown_timeout_s) for c in self.pools[sid].clients()))
        if self._master is not None:  # after the clients: headless replicas say goodbye through it
            await self._master.close()
            self._master = None
        if self._ray is not None:  # every actor is gone; a Ray we started stops here
            self._ray.close()
            self._ray = None
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._threads_before is not None:
            import torch

            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        leaked = sweep_shared_memory(self._shm_prefix)
        if leaked:
            logger.warning("removed %d shared memory segment(s) that were never received", leaked)

    def _replica_down(self, stage_id: int, reason: str, *, replica: int) -> None:
        """A replica's client saw it go DOWN: the owner fails or moves its requests, then the
        supervisor restarts it (a headless replica is restarted by whoever started it; it
        registers again). One that is only silent is restarted once it is killed (its client
        reports DOWN again then), unless it speaks again first."""
        pool = self.pools[stage_id]
        ref = pool.ref(replica)
        client = pool.replicas[replica]
        assert client is not None
        self._down_reasons[ref] = reason
        if client.silent:
            client.remember_orphans(pool.keys_on(replica))
        self._on_down(stage_id, reason, replica=replica)
        if not self._closing and not client.silent and not isinstance(client.launcher, RemoteLauncher):
            self.supervisor.on_down(ref, reason)

    # --- health ---------------------------------------------------------------
    def health(self) -> list[StageHealth]:
        return [self.stage_health(sid) for sid in self.pools]

    def stage_health(self, stage_id: int) -> StageHealth:
        pool = self.pools[stage_id]
        return pool.health([self._replica_health(pool.ref(r), c) for r, c in enumerate(pool.replicas)
                            if c is not None])

    def _replica_health(self, ref: ReplicaRef, client: StageClient) -> StageHealth:
        health = client.health()
        if self.supervisor.restarting(ref):  # down (or starting again): when to retry
            return dataclasses.replace(health, state=StageState.RESTARTING, reason=self._down_reasons.get(ref),
                                       retry_after_s=self.supervisor.retry_after(ref))
        gave_up = self.supervisor.gave_up(ref)
        if health.state == StageState.DOWN and gave_up is not None:
            return dataclasses.replace(health, reason=gave_up)
        return health

    def transport_drops(self) -> dict[DropKey, int]:
        """What this process's ends of the stage links dropped, by socket, stage and reason."""
        return self.drops.snapshot()

    async def stage_stats(self, stage_id: int, timeout_s: float) -> StageStats:
        if stage_id not in self.pools:
            raise KeyError(f"no stage {stage_id}; stages: {sorted(self.pools)}")
        return await self.pools[stage_id].stats(timeout_s)
