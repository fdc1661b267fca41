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
Launching, restarting, health and shutdown of the replicas are the `StageFleet`'s
(stage_fleet.py); this module is about the requests.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.stage_config import PipelineConfig, StageConfig, WorkerType
from vllm_omni.engine.cluster_secret import CurveKeys
from vllm_omni.engine.messages import AbortRequests, PauseRequests, StageOutputBatch
from vllm_omni.engine.load_balancer import DEFAULT_LB_POLICY
from vllm_omni.engine.pipeline_sleep import SLEEPING, PipelineSleep
from vllm_omni.engine.playback_admission import AdmissionOptions, PlaybackAdmission
from vllm_omni.engine.streaming import EdgeFlow, StreamingEdge, resolve_streaming_edges
from vllm_omni.stage_io import OutputKind, StageInputChunk, StageOutput, StageRequest
from vllm_omni.engine.request_plan import RequestPlan
from vllm_omni.engine.request_state import RequestDone, RequestSink, RequestState
from vllm_omni.engine.stage_client import StageDownError, StageState
from vllm_omni.engine.ray_cluster import worker_backend_problem
from vllm_omni.engine.stage_fleet import StageFleet
from vllm_omni.engine.transport_guard import (
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REPLICAS_PER_STAGE, DEFAULT_REGISTRATION_RATE,
)
from vllm_omni.engine.stage_input import build_stage_input, resolve_input_processor
from vllm_omni.outputs import RequestOutputKind
from vllm_omni.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    stage_init_timeout_s: float = 300.0
    init_timeout_s: float = 600.0
    shm_threshold_bytes: int = 65536
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0  # a stage silent this long is DOWN; 3x as long: killed, restarted
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
    # The stage transport's guards (docs/operations.md, "Security: the stage transport").
    cluster_keys: CurveKeys | None = field(default=None, repr=False)  # None: the master listens on loopback only
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_replicas_per_stage: int = DEFAULT_MAX_REPLICAS_PER_STAGE
    registration_rate: float = DEFAULT_REGISTRATION_RATE
    # New audio requests wait (or are refused) past the playback load (playback_admission.py).
    admission: AdmissionOptions = field(default_factory=AdmissionOptions)

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= 1")
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
    input_complete: bool = True  # False: more input follows (append_input), e.g. text as it is typed


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
        self.fleet = StageFleet(pipeline, model, options, self._on_message, self._on_stage_down)
        self.pools = self.fleet.pools  # routing goes through each stage's replica pool
        self.sleep_mode = PipelineSleep(pipeline, self.pools, options.stage_init_timeout_s)
        self._streaming: dict[int, StreamingEdge] = {}  # by downstream stage, once the stages are up
        self._requests: dict[str, RequestState] = {}  # internal key -> state
        self._keys: dict[str, str] = {}  # user request id -> internal key
        self._counter = itertools.count()
        self.stage_counters: dict[int, Counter[str]] = {sid: Counter() for sid in self.stages}
        # --enable-ar-profiler: the time a request spends in these stages goes in its stage_durations.
        self._profiled = {sid for sid, s in self.stages.items()
                          if s.engine_args.enable_ar_profiler and s.worker_type != WorkerType.DIFFUSION}
        self._audio_stages = frozenset(s.stage_id for s in pipeline.stages if s.final_output_type.value == "audio")
        self.admission: PlaybackAdmission[Submission] = PlaybackAdmission(
            options.admission, self._start, self._overloaded, lambda delay, fn: asyncio.get_running_loop().call_later(
                delay, fn))
        # Streamed input (input_complete=False) that arrives while admission holds its request.
        self._input_while_queued: dict[str, list[tuple[dict[str, Any], bool]]] = {}

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Every stage up (else the fleet stops them all and raises), then the streaming edges."""
        await self.fleet.start()
        try:
            self._streaming = resolve_streaming_edges(self.pipeline, self.model,
                                                      {sid: p.info for sid, p in self.pools.items()},
                                                      self.options.stream_max_pending_units)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._fail_queued("the pipeline is shutting down")
        for state in list(self._requests.values()):
            self._fail(state, "the pipeline is shutting down", None)
        await self.fleet.close()
        if self.options.log_stats:
            for sid, counters in self.stage_counters.items():
                logger.info("%s: %s", self.pools[sid].name, dict(counters))
            logger.info("admission by playback load: %s", dict(self.admission.counters))

    # --- requests -------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        try:
            self._submit(sub)
        except Exception as e:  # noqa: BLE001 - whatever broke, the request ends with an error
            self._fail_unexpected(sub.request_id, sub.sink, e, None)

    def _submit(self, sub: Submission) -> None:
        if self.sleep_mode.sleeping:
            sub.sink.put(RequestDone(sub.request_id, error=SLEEPING))
            return
        if sub.request_id in self._keys or self.admission.is_queued(sub.request_id):
            sub.sink.put(RequestDone(sub.request_id, error=f"request id {sub.request_id!r} is already in flight"))
            return
        self.admission.submit(sub, sub.request_id, audio=bool(sub.plan.outputs & self._audio_stages))

    def _overloaded(self, sub: Submission, why: str) -> None:
        self._input_while_queued.pop(sub.request_id, None)
        sub.sink.put(RequestDone(sub.request_id, error=why, overloaded=True))

    def _start(self, sub: Submission) -> str | None:
        """Send an admitted request to its entry stages; its key (None: it failed at once)."""
        try:
            return self._start_request(sub)
        except Exception as e:  # noqa: BLE001 - whatever broke, the request ends with an error
            self._fail_unexpected(sub.request_id, sub.sink, e, None)
            return None

    def _start_request(self, sub: Submission) -> str | None:
        # Only the stages this request runs must be up (a text-only request survives a dead talker).
        down = [self.fleet.stage_health(sid) for sid, p in self.pools.items() if sid in sub.plan.stages and not p.is_up]
        if down:
            reason = "; ".join(f"{self.pools[h.stage_id].name} is {h.state.value}: {h.reason or 'not ready'}"
                               for h in down)
            sub.sink.put(RequestDone(sub.request_id, error=reason, failed_stage=down[0].stage_id))
            return None
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
                              sub.prompt.get("multi_modal_data"), input_complete=sub.input_complete):
                return None
        for info, final in self._input_while_queued.pop(sub.request_id, ()):
            self.append_input(sub.request_id, info, final)
        return key

    async def sleep(self, level: int) -> None:
        # Requests that playback admission holds count too: they would start in a sleeping pipeline.
        await self.sleep_mode.sleep(level, in_flight=lambda: len(self._requests) + self.admission.queued)

    def append_input(self, request_id: str, info: dict[str, Any], final: bool) -> None:
        """More input for a request submitted with input_complete=False: a chunk to each entry
        stage still running it (one that finished early, e.g. at max_tokens, gets nothing)."""
        if self.admission.is_queued(request_id):  # sent when admission starts it
            self._input_while_queued.setdefault(request_id, []).append((info, final))
            return
        key = self._keys.get(request_id)
        if key is None:
            return  # finished or aborted meanwhile
        state = self._requests[key]
        for stage in self.pipeline.entry_stages:
            sid = stage.stage_id
            if sid in state.stages and sid not in state.finished_stages:
                chunk = StageInputChunk(request_id=state.key, additional_information=info, final=final)
                if not self._send_message(state, sid, chunk):
                    return

    def abort(self, request_id: str) -> None:
        queued = self.admission.take(request_id)
        self._input_while_queued.pop(request_id, None)
        if queued is not None:
            queued.sink.put(RequestDone(request_id, aborted=True))
            return
        key = self._keys.get(request_id)
        if key is None:
            return  # finished (or never existed): nothing to abort
        state = self._requests[key]
        self._drop(state)
        state.sink.put(RequestDone(request_id, aborted=True))

    # --- routing --------------------------------------------------------------
    def _send(self, state: RequestState, stage_id: int, ids: list[int], text: str | None,
              info: dict[str, Any], mm: Any, input_complete: bool = True) -> bool:
        state.start_stage(stage_id, ids, text)
        # Intermediate outputs are needed by a caller that streams and by streaming edges (both
        # ways: a downstream stage reports what it consumed).
        partial = ((stage_id in state.output_stages and state.sink.output_kind != RequestOutputKind.FINAL_ONLY)
                   or self._streams(state, stage_id))
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
        made = state.apply(stage_id, out)
        if stage_id in self._audio_stages:
            self._audio_chunk(state, stage_id, out)
        if out.finished:
            pool.release(state.key)
            if stage_id in self._profiled:
                timing = state.timings[stage_id]
                state.stage_durations[f"ar_stage_{stage_id}"] = timing.finished_at - timing.sent_at
        stage = self.stages[stage_id]
        if made is not None and stage_id in state.output_stages:
            state.sink.put(state.final_output(stage_id, stage.final_output_type.value, made))
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
        sources = {src: state.output(src) for src in stage.engine_input_source}
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
        try:
            if not flow.started:
                inp = edge.bridge.start(state.output(edge.src), state.prompt)
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
            state.output(edge.dst).prompt_token_ids = edge.bridge.prompt_token_ids(flow.units.view)

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

    def _audio_chunk(self, state: RequestState, stage_id: int, out: StageOutput) -> None:
        """The playback load counts every chunk of audio the pipeline hands on."""
        audio = out.multimodal_output.get("audio")
        rate = state.output(stage_id).outputs[0].multimodal_output.get("sample_rate")
        if audio is not None and rate is not None and int(rate) > 0:
            self.admission.chunk(state.key, audio.numel() / int(rate))

    def _count(self, state: RequestState, stage_id: int) -> None:
        c = self.stage_counters[stage_id]
        t = state.timings[stage_id]
        c["requests"] += 1
        c["output_tokens"] += len(state.output(stage_id).outputs[0].token_ids)
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
        self.admission.finished(state.key)  # may start a queued request

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
        """A replica went DOWN: its requests move to another replica or fail (the fleet restarts it)."""
        pool = self.pools[stage_id]
        ref = pool.ref(replica)
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

    def _fail_queued(self, error: str) -> None:
        while self.admission.queued:
            sub = self.admission.take_first()
            self._input_while_queued.pop(sub.request_id, None)
            sub.sink.put(RequestDone(sub.request_id, error=error))

    def fail_all(self, error: str) -> None:
        """Used when the loop stops for good: no request may wait forever."""
        self._fail_queued(error)
        for state in list(self._requests.values()):
            self._fail(state, error, None)

