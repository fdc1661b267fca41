"""The orchestrator: owns request state and the stage graph; routes every output at once.

It lives on one asyncio loop (see `runtime.OmniRuntime`). Each stage client awaits its
own socket and calls `_on_message` for every message as it arrives. When a request
finishes at a stage, each downstream stage whose sources have all finished it gets its
input from the bridge (spec 003 `_forward_to_next_stage`); over a streaming edge
(streaming.py) the downstream stage starts early and gets the rest chunk by chunk. A
request is done when every stage has finished it; a failure anywhere fails it everywhere
(abort in every stage).

A stage may run several replicas (`runtime.num_replicas`): its `StagePool` (replica_pool.py)
routes each request's first message there by `--omni-lb-policy` and its later messages to the
same replica. A replica that dies moves the requests it had not answered yet to another
replica (once); the rest fail, and the supervisor restarts the replica (docs/deployment.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.engine.messages import AbortRequests, PauseRequests, StageOutputBatch, StageStats
from vllm_omni.engine.load_balancer import DEFAULT_LB_POLICY, make_policy
from vllm_omni.engine.replica_pool import ReplicaRef, StagePool, replica_configs
from vllm_omni.engine.streaming import EdgeFlow, StreamingEdge, resolve_streaming_edges
from vllm_omni.stage_io import OutputKind, StageInputChunk, StageOutput, StageRequest
from vllm_omni.engine.request_plan import RequestPlan
from vllm_omni.engine.request_state import RequestDone, RequestSink, RequestState
from vllm_omni.engine.stage_client import StageClient, StageDownError, StageHealth, StageState
from vllm_omni.engine.ray_cluster import RayCluster, worker_backend_problem
from vllm_omni.engine.stage_input import build_stage_input, resolve_input_processor
from vllm_omni.engine.registration import pipeline_summary
from vllm_omni.engine.stage_launcher import (
    ProcessLauncher, StageLauncher, ThreadLauncher, limit_own_torch_threads, torch_threads_for,
)
from vllm_omni.engine.stage_master import StageMaster
from vllm_omni.engine.stage_worker import WorkerSpec
from vllm_omni.engine.supervisor import StageSupervisor
from vllm_omni.engine.transport import OrchestratorChannel, make_ipc_dir, stage_addresses, sweep_shared_memory
from vllm_omni.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    stage_init_timeout_s: float = 300.0
    init_timeout_s: float = 600.0
    shm_threshold_bytes: int = 65536
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0  # a stage silent this long is DOWN (and restarted)
    shutdown_timeout_s: float = 10.0
    log_stats: bool = False
    # Flow control of streaming edges: units sent but not consumed before the producer pauses.
    stream_max_pending_units: int = 512
    max_stage_restarts: int = 3  # restarts of a failed stage before it stays DOWN (engine/supervisor.py)
    lb_policy: str = DEFAULT_LB_POLICY  # which replica of a stage takes a new request (load_balancer.py)
    worker_backend: str = "multi_process"  # or "ray": stages as Ray actors (engine/ray_cluster.py)
    ray_address: str | None = None  # None: RAY_ADDRESS, else a local Ray instance of our own
    # The stage-based CLI (engine/stage_master.py): the one stage this process launches (None:
    # every stage), and where headless stages register (None: nowhere).
    local_stage: int | None = None
    master_address: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        problem = worker_backend_problem(self.worker_backend, self.ray_address)
        if problem is not None:
            raise ValueError(problem)
        if (self.master_address is None) != (self.master_port is None):
            raise ValueError("headless stages register at --omni-master-address and --omni-master-port: give both")
        if self.master_address is not None and self.worker_backend != "multi_process":
            raise ValueError("headless stages (a master address) do not combine with worker_backend="
                             f"{self.worker_backend!r}")


@dataclass
class Submission:
    request_id: str
    prompt: Any  # the processed prompt (OmniTokensPrompt), handed to bridges
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per stage
    sink: RequestSink
    plan: RequestPlan  # which stages run, which outputs are returned


class Orchestrator:
    def __init__(self, pipeline: PipelineConfig, model: str, options: RuntimeOptions) -> None:
        self.pipeline = pipeline
        self.model = model
        self.options = options
        self.stages: dict[int, StageConfig] = {s.stage_id: s for s in pipeline.stages}
        self._downstream = {sid: [s.stage_id for s in pipeline.stages if sid in s.engine_input_source]
                            for sid in self.stages}
        self._bridges = {s.stage_id: resolve_input_processor(s, model) for s in pipeline.stages
                         if s.engine_input_source}
        self._check_stage_cli()
        # Every replica's own stage config (its devices, its replica id), checked before anything starts.
        self._replica_stages = {s.stage_id: replica_configs(s) for s in pipeline.stages}
        self.pools = {s.stage_id: StagePool(s.stage_id, s.model_stage, self._local_replicas(s),
                                            make_policy(options.lb_policy)) for s in pipeline.stages}
        self._streaming: dict[int, StreamingEdge] = {}  # by downstream stage, once the stages are up
        self._requests: dict[str, RequestState] = {}  # internal key -> state
        self._keys: dict[str, str] = {}  # user request id -> internal key
        self._counter = itertools.count()
        # Names every shared memory segment this pipeline creates, so close() can sweep leftovers.
        self._shm_prefix = f"vomni-{os.getpid()}-{uuid.uuid4().hex[:6]}-"
        self._ipc_dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._threads_before: int | None = None  # the orchestrator thread's torch threads before start()
        self.stage_counters: dict[int, Counter[str]] = {sid: Counter() for sid in self.stages}
        self.supervisor = StageSupervisor(self.restart_replica, options.max_stage_restarts)
        self._launches: Counter[ReplicaRef] = Counter()  # per replica: a restart gets fresh socket addresses
        self._down_reasons: dict[ReplicaRef, str] = {}  # why a replica last went down
        self._closing = False
        self._ray: RayCluster | None = None  # worker_backend "ray": the cluster the stage actors run on
        self._master: StageMaster | None = None  # the stage-based CLI's registration socket

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
            self._streaming = resolve_streaming_edges(self.pipeline, self.model,
                                                      {sid: p.info for sid, p in self.pools.items()},
                                                      self.options.stream_max_pending_units)
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
        opts = self.options
        spec = WorkerSpec(
            stage=stage, model=self.model, in_addr=in_addr, out_addr=out_addr,
            shm_threshold_bytes=opts.shm_threshold_bytes, shm_prefix=self._shm_prefix,
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
        channel = OrchestratorChannel(self._ctx, in_addr, out_addr, opts.shm_threshold_bytes, self._shm_prefix)
        client = self._client(stage.stage_id, replica, launcher, channel, ref.name)
        client.start()
        return client

    def _client(self, stage_id: int, replica: int, launcher: StageLauncher, channel: OrchestratorChannel,
                name: str) -> StageClient:
        """A replica's client, wired to this orchestrator and put in its pool's slot (not started)."""
        client = StageClient(stage_id, self.stages[stage_id].model_stage, launcher, channel,
                             on_message=functools.partial(self._on_message, replica=replica),
                             on_down=functools.partial(self._on_stage_down, replica=replica),
                             heartbeat_timeout_s=self.options.heartbeat_timeout_s, name=name)
        self.pools[stage_id].replicas[replica] = client
        return client

    async def _start_master(self) -> None:
        assert self._ctx is not None and self.options.master_address is not None
        opts = self.options
        summary = pipeline_summary(self.pipeline, self.model)

        def remote_client(stage_id: int, replica: int, launcher: StageLauncher,
                          channel: OrchestratorChannel) -> StageClient:
            return self._client(stage_id, replica, launcher, channel, f"{self.pools[stage_id].name} replica {replica}")

        self._master = StageMaster(
            self._ctx, opts.master_address, opts.master_port, self.model, summary, self.pools, remote_client,
            heartbeat_interval_s=min(opts.heartbeat_interval_s, opts.heartbeat_timeout_s / 4),
            heartbeat_timeout_s=opts.heartbeat_timeout_s, stage_init_timeout_s=opts.stage_init_timeout_s)
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
        self._closing = True
        await self.supervisor.close()
        for state in list(self._requests.values()):
            self._fail(state, "the pipeline is shutting down", None)
        # In pipeline order: nothing flows into a stage after its sources have stopped.
        for sid in self.pipeline.topo_order():
            await asyncio.gather(*(c.close(self.options.shutdown_timeout_s) for c in self.pools[sid].clients()))
        if self._master is not None:  # after the clients: headless replicas say goodbye through it
            await self._master.close()
            self._master = None
        if self._ray is not None:  # every actor is gone; a Ray we started stops here
            self._ray.close()
            self._ray = None
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
        if self.options.log_stats:
            for sid, counters in self.stage_counters.items():
                logger.info("%s: %s", self.pools[sid].name, dict(counters))

    # --- requests -------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        try:
            self._submit(sub)
        except Exception as e:  # noqa: BLE001 - whatever broke, the request ends with an error
            self._fail_unexpected(sub.request_id, sub.sink, e, None)

    def _submit(self, sub: Submission) -> None:
        if sub.request_id in self._keys:
            sub.sink.put(RequestDone(sub.request_id, error=f"request id {sub.request_id!r} is already in flight"))
            return
        # Only the stages this request runs must be up (a text-only request survives a dead talker).
        down = [self._health(sid) for sid, p in self.pools.items() if sid in sub.plan.stages and not p.is_up]
        if down:
            reason = "; ".join(f"{self.pools[h.stage_id].name} is {h.state.value}: {h.reason or 'not ready'}"
                               for h in down)
            sub.sink.put(RequestDone(sub.request_id, error=reason, failed_stage=down[0].stage_id))
            return
        key = f"{sub.request_id}#{next(self._counter)}"
        state = RequestState(sub.request_id, key, sub.prompt, sub.prompt_token_ids, sub.params, sub.sink,
                             stages=sub.plan.stages, output_stages=sub.plan.outputs)
        self._requests[key] = state
        self._keys[sub.request_id] = key
        text = sub.prompt.get("prompt")
        info = dict(sub.prompt.get("additional_information") or {})
        for stage in self.pipeline.entry_stages:
            if stage.stage_id not in state.stages:
                continue
            if not self._send(state, stage.stage_id, sub.prompt_token_ids, text, info,
                              sub.prompt.get("multi_modal_data")):
                return

    def abort(self, request_id: str) -> None:
        key = self._keys.get(request_id)
        if key is None:
            return  # finished (or never existed): nothing to abort
        state = self._requests[key]
        self._drop(state)
        state.sink.put(RequestDone(request_id, aborted=True))

    def health(self) -> list[StageHealth]:
        return [self._health(sid) for sid in self.pools]

    def _health(self, stage_id: int) -> StageHealth:
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

    async def stage_stats(self, stage_id: int, timeout_s: float) -> StageStats:
        if stage_id not in self.pools:
            raise KeyError(f"no stage {stage_id}; stages: {sorted(self.pools)}")
        return await self.pools[stage_id].stats(timeout_s)

    # --- routing --------------------------------------------------------------
    def _send(self, state: RequestState, stage_id: int, ids: list[int], text: str | None,
              info: dict[str, Any], mm: Any, input_complete: bool = True) -> bool:
        state.start_stage(stage_id, ids, text)
        # Intermediate outputs are needed by a caller that streams and by streaming edges (both
        # ways: a downstream stage reports what it consumed).
        partial = (stage_id in state.output_stages and state.sink.wants_partial) or self._streams(state, stage_id)
        req = StageRequest(request_id=state.key, prompt_token_ids=ids, sampling_params=state.params[stage_id],
                           prompt=text, additional_information=info, multi_modal_data=mm,
                           output_kind=OutputKind.DELTA if partial else OutputKind.FINAL_ONLY,
                           input_complete=input_complete)
        try:
            self.pools[stage_id].route(state.key)
        except StageDownError as e:
            self._fail(state, str(e), stage_id)
            return False
        state.replay[stage_id] = []
        return self._send_message(state, stage_id, req)

    def _send_message(self, state: RequestState, stage_id: int, msg: Any) -> bool:
        """Send to the replica that holds the request (pool.route chose it)."""
        if stage_id in state.replay and isinstance(msg, (StageRequest, StageInputChunk)):
            state.replay[stage_id].append(msg)
        return self._deliver(state, stage_id, msg)

    def _deliver(self, state: RequestState, stage_id: int, msg: Any) -> bool:
        client = self.pools[stage_id].client_of(state.key)
        assert client is not None, f"request {state.key} was not routed to stage {stage_id}"
        try:
            client.send(msg)
        except StageDownError as e:
            self._fail(state, str(e), stage_id)
            return False
        except Exception as e:  # noqa: BLE001 - a payload that cannot be encoded (TypeError, OverflowError, ...)
            self._fail(state, f"{client.name}: cannot send the request: {type(e).__name__}: {e}", stage_id)
            return False
        return True

    def _streams(self, state: RequestState, stage_id: int) -> bool:
        """The stage is an end of a streaming edge this request runs."""
        return any(e.dst in state.stages and stage_id in (e.src, e.dst) for e in self._streaming.values())

    def _on_message(self, stage_id: int, msg: Any, *, replica: int) -> None:
        if not isinstance(msg, StageOutputBatch):
            logger.error("%s sent an unexpected %s", self.pools[stage_id].ref(replica), type(msg).__name__)
            return
        for out in msg.outputs:
            try:
                self._on_output(stage_id, replica, out)
            except Exception as e:  # noqa: BLE001 - routing one output failed: that request ends, not the loop
                state = self._requests.get(out.request_id)
                if state is not None:
                    self._fail_unexpected(state.request_id, state.sink, e, stage_id)

    def _on_output(self, stage_id: int, replica: int, out: StageOutput) -> None:
        state = self._requests.get(out.request_id)
        if state is None or stage_id not in state.outputs or stage_id not in state.stages \
                or stage_id in state.finished_stages:
            return  # aborted or failed meanwhile; the stage was told to drop it
        pool = self.pools[stage_id]
        if pool.replica_of(state.key) != replica:
            return  # from a replica that died holding it: the request moved on (_on_stage_down)
        if out.error is not None:
            self._fail(state, out.error, stage_id)
            return
        state.replay.pop(stage_id, None)  # it answered: from now on the request stays on this replica
        state.apply(stage_id, out)
        if out.finished:
            pool.release(state.key)
        stage = self.stages[stage_id]
        if stage_id in state.output_stages and (out.finished or state.sink.wants_partial):
            state.sink.put(state.final_output(stage_id, stage.final_output_type.value, partial=not out.finished))
        edge_in = self._streaming.get(stage_id)
        if edge_in is not None and stage_id in state.flows:
            self._consumed(state, edge_in, out)
        for dst in self._downstream[stage_id]:
            # Stages no requested output needs do not run (request_plan).
            if dst not in state.stages or dst in state.finished_stages:
                continue
            edge = self._streaming.get(dst)
            if edge is not None:
                if not self._stream(state, edge, out):
                    return
            elif out.finished and all(src in state.finished_stages for src in self.stages[dst].engine_input_source):
                if not self._forward(state, dst):
                    return
        if not out.finished:
            return
        self._count(state, stage_id)
        if state.done:
            self._finish(state)

    def _forward(self, state: RequestState, dst: int) -> bool:
        stage = self.stages[dst]
        fn, fn_name = self._bridges[dst]
        sources = {src: state.outputs[src] for src in stage.engine_input_source}
        try:
            # Bridges are small tensor reshuffles; they run inline on the loop.
            inp = build_stage_input(fn, fn_name, stage, len(self.stages), sources, state.prompt, state.request_id)
        except Exception as e:  # noqa: BLE001 - a bridge that raises fails this request alone
            self._fail(state, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}", dst)
            return False
        return self._send(state, dst, inp["prompt_token_ids"], None, inp.get("additional_information") or {},
                          inp.get("multi_modal_data"))

    def _stream(self, state: RequestState, edge: StreamingEdge, delta: StageOutput) -> bool:
        """One upstream delta over a streaming edge: start the downstream request, or send a chunk."""
        flow = state.flows.setdefault(edge.dst, EdgeFlow())
        stage = self.stages[edge.dst]
        try:
            if not flow.started:
                inp = edge.bridge.start(state.outputs[edge.src], state.prompt)
                if inp is None:
                    return True
                flow.started = True
                if not delta.finished:
                    self.stage_counters[edge.dst]["early_starts"] += 1  # started before its upstream ended
                info = dict(inp.get("additional_information") or {})
                if not self._send(state, edge.dst, list(inp["prompt_token_ids"]), None, info,
                                  inp.get("multi_modal_data"), input_complete=delta.finished):
                    return False
                self._record_units(state, edge, flow, info)
                return True
            flow.hold(edge.bridge.chunk(delta))
        except ValueError as e:
            self._fail(state, f"stage {edge.dst}: streaming input for request {state.request_id}: {e}", edge.dst)
            return False
        if not delta.finished and flow.pending_units < edge.window:
            return True
        chunk = StageInputChunk(request_id=state.key, additional_information=flow.take(), final=delta.finished)
        if not self._send_message(state, edge.dst, chunk):
            return False
        self._record_units(state, edge, flow, chunk.additional_information)
        counters = self.stage_counters[edge.dst]
        counters["max_backlog"] = max(counters["max_backlog"], flow.backlog)
        if not delta.finished and not flow.paused and flow.backlog > edge.max_pending_units:
            self._pause(state, edge, flow, True)
        return True

    def _record_units(self, state: RequestState, edge: StreamingEdge, flow: EdgeFlow, info: dict[str, Any]) -> None:
        """The downstream output reports the prompt ids the non-streaming bridge would have sent."""
        if edge.bridge.prompt_token_ids is None:
            return
        flow.record_units(info)
        if flow.units is not None:
            state.outputs[edge.dst].prompt_token_ids = edge.bridge.prompt_token_ids(flow.units.view)

    def _consumed(self, state: RequestState, edge: StreamingEdge, out: StageOutput) -> None:
        """The downstream end of a streaming edge reported progress: resume its producer once
        the backlog is down (or the consumer is done)."""
        flow = state.flows[edge.dst]
        if out.consumed_units is not None:
            flow.consumed = out.consumed_units
        if flow.paused and (out.finished or flow.backlog <= edge.resume_below):
            self._pause(state, edge, flow, False)

    def _pause(self, state: RequestState, edge: StreamingEdge, flow: EdgeFlow, paused: bool) -> None:
        if edge.src in state.finished_stages:
            return
        flow.paused = paused
        self._send_message(state, edge.src, PauseRequests([state.key], paused))
        self.stage_counters[edge.src]["pauses" if paused else "resumes"] += 1

    def _count(self, state: RequestState, stage_id: int) -> None:
        c = self.stage_counters[stage_id]
        t = state.timings[stage_id]
        c["requests"] += 1
        c["output_tokens"] += len(state.outputs[stage_id].outputs[0].token_ids)
        c["busy_ms"] += int(1000 * ((t.finished_at or t.sent_at) - t.sent_at))

    # --- failures -------------------------------------------------------------
    def _fail(self, state: RequestState, error: str, stage_id: int | None) -> None:
        """A stage failed the request: it and every stage fed by it end there; the rest go on
        when an output the caller asked for does not depend on it (the thinker's text survives
        a failed talker), and the request then ends with the error and what it has."""
        if state.key not in self._requests:
            return
        logger.warning("request %s failed: %s", state.request_id, error)
        dead = self._fed_by(stage_id) & state.stages if stage_id is not None else state.stages
        if not state.output_stages - dead:
            self._drop(state)
            state.sink.put(RequestDone(state.request_id, error=error, failed_stage=stage_id))
            return
        self._abort_in(state, dead)
        for flow_dst, flow in state.flows.items():  # a producer held back for a dead consumer goes on
            edge = self._streaming[flow_dst]
            if flow_dst in dead and flow.paused and edge.src not in dead:
                self._pause(state, edge, flow, False)
        state.stages, state.output_stages = state.stages - dead, state.output_stages - dead
        state.failure = (error, stage_id)
        if state.done:
            self._finish(state)

    def _fed_by(self, stage_id: int) -> frozenset[int]:
        """The stage and every stage downstream of it."""
        found, todo = set(), [stage_id]
        while todo:
            sid = todo.pop()
            if sid not in found:
                found.add(sid)
                todo.extend(self._downstream[sid])
        return frozenset(found)

    def _finish(self, state: RequestState) -> None:
        self._drop(state, abort_in_stages=False)
        if self.options.log_stats:
            logger.info(state.timing_summary({sid: p.name for sid, p in self.pools.items()}))
        error, failed_stage = state.failure or (None, None)
        state.sink.put(RequestDone(state.request_id, error=error, failed_stage=failed_stage))

    def _fail_unexpected(self, request_id: str, sink: RequestSink, exc: Exception, stage_id: int | None) -> None:
        """A bug or an unforeseen payload broke the handling of one request: end it, keep serving."""
        logger.error("request %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
        state = self._requests.get(self._keys.get(request_id, ""))
        error = f"internal error while routing the request: {type(exc).__name__}: {exc}"
        if state is not None and state.sink is sink:
            self._fail(state, error, stage_id)
        else:
            sink.put(RequestDone(request_id, error=error, failed_stage=stage_id))

    def _drop(self, state: RequestState, abort_in_stages: bool = True) -> None:
        self._requests.pop(state.key, None)
        if self._keys.get(state.request_id) == state.key:
            del self._keys[state.request_id]
        if abort_in_stages:
            self._abort_in(state, frozenset(state.outputs))
        for pool in self.pools.values():
            pool.release(state.key)

    def _abort_in(self, state: RequestState, stage_ids: frozenset[int]) -> None:
        """Abort the request in those of `stage_ids` that got it and have not finished it."""
        for sid in stage_ids & state.outputs.keys():
            client = self.pools[sid].client_of(state.key)
            if sid not in state.finished_stages and client is not None and client.state == StageState.UP:
                try:
                    client.send(AbortRequests([state.key]))  # frees its KV blocks there
                except StageDownError as e:
                    logger.info("abort of %s not delivered: %s", state.request_id, e)  # a down stage holds nothing
            self.pools[sid].release(state.key)

    def _on_stage_down(self, stage_id: int, reason: str, *, replica: int) -> None:
        pool = self.pools[stage_id]
        ref = pool.ref(replica)
        self._down_reasons[ref] = reason
        for key in pool.keys_on(replica):
            state = self._requests[key]
            if not self._move_to_another_replica(state, stage_id):
                self._fail(state, f"{ref.name} is down: {reason}", stage_id)
        if not pool.is_up:
            for state in list(self._requests.values()):
                # Requests that need the stage and have not finished with it; a text-only request
                # running beside a dead talker goes on.
                if stage_id in state.stages and stage_id not in state.finished_stages:
                    self._fail(state, f"{ref.name} is down: {reason}", stage_id)
        # A headless replica is restarted by whoever started it; it registers again.
        if not self._closing and not (self._master is not None and self._master.is_remote(pool.replicas[replica])):
            self.supervisor.on_down(ref, reason)

    def _move_to_another_replica(self, state: RequestState, stage_id: int) -> bool:
        """Replay what the stage got for a request that lost its replica before that replica
        answered anything (so nothing of it reached the caller or a downstream stage), on an
        UP replica, once per stage. False: it cannot move (it must fail)."""
        sent = state.replay.get(stage_id)
        pool = self.pools[stage_id]
        if sent is None or stage_id in state.retried or not pool.is_up:
            return False
        state.retried.add(stage_id)
        lost = pool.client_of(state.key)
        assert lost is not None
        client = pool.route(state.key)
        logger.warning("request %s moves from %s to %s", state.request_id, lost.name, client.name)
        self.stage_counters[stage_id]["moved_to_another_replica"] += 1
        for msg in sent:
            if not self._deliver(state, stage_id, msg):
                break  # it failed (and was told so)
        return True

    def fail_all(self, error: str) -> None:
        """Used when the loop stops for good: no request may wait forever."""
        for state in list(self._requests.values()):
            self._fail(state, error, None)

