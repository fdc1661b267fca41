"""Prometheus metrics of the API server (`GET /metrics`).

Request-level series are recorded as requests finish; per-stage gauges are refreshed from
the stages (`AsyncOmni.get_stage_stats`, one round trip per stage, with a deadline) each
time /metrics is scraped. Each app has its own registry, so two servers in one process (tests)
do not collide.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from vllm_omni.engine.stage_client import StageState
from vllm_omni.engine.transport_guard import DropKey, merge_counts

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0)
STATS_TIMEOUT_S = 2.0  # per scrape: a busy stage answers between engine steps

# The `_created` series double every counter and histogram for a timestamp nobody graphs.
disable_created_metrics()


class ServerMetrics:
    def __init__(self, stage_names: dict[int, str]) -> None:
        self.registry = CollectorRegistry()
        self.stage_names = stage_names
        r = self.registry
        self.requests = Counter("vllm_omni:requests", "HTTP requests by endpoint and final status "
                                "(499: the client disconnected)", ["endpoint", "status"], registry=r)
        self.e2e = Histogram("vllm_omni:e2e_request_latency_seconds", "Arrival to last output of successful "
                             "generation requests", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("vllm_omni:time_to_first_token_seconds", "Arrival to the first generated text",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("vllm_omni:time_to_first_audio_seconds", "Arrival to the first audio samples",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.audio_gap = Histogram("vllm_omni:audio_inter_chunk_gap_seconds", "Time between two audio chunks of "
                                   "one request reaching the server (streaming playback underruns when it "
                                   "exceeds the previous chunk's duration)", buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("vllm_omni:audio_real_time_factor", "Arrival-to-last-audio time / audio duration "
                             "(< 1: faster than real time)", buckets=_RTF_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm_omni:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("vllm_omni:generation_tokens", "Text tokens generated", registry=r)
        self.audio_seconds = Counter("vllm_omni:audio_seconds_generated", "Seconds of audio generated", registry=r)
        self.running = Gauge("vllm_omni:num_requests_running", "Requests admitted into the pipeline", registry=r)
        self.queued = Gauge("vllm_omni:num_requests_waiting", "Requests waiting for admission", registry=r)
        labels = ["stage", "model_stage"]
        self.stage_up = Gauge("vllm_omni:stage_up", "1 while the stage is UP", labels, registry=r)
        self.stage_replicas = Gauge("vllm_omni:stage_replicas", "Replicas of the stage in each state",
                                    ["stage", "state"], registry=r)
        self.stage_unfinished = Gauge("vllm_omni:stage_num_requests", "Requests the stage holds (queued + "
                                      "running)", labels, registry=r)
        self.stage_queue = Gauge("vllm_omni:stage_queue_depth", "Requests waiting in the stage's scheduler",
                                 labels, registry=r)
        self.stage_batch = Gauge("vllm_omni:stage_batch_size", "Requests the stage is running (its batch)",
                                 labels, registry=r)
        self.stage_kv_usage = Gauge("vllm_omni:stage_kv_cache_usage_perc", "Fraction of the KV blocks in use "
                                    "(AR stages)", labels, registry=r)
        self.diffusion_steps = Gauge("vllm_omni:stage_diffusion_steps_done", "Denoising steps done (one per "
                                     "request per step) since the stage started (diffusion stages)", labels,
                                     registry=r)
        self.stage_durations = Histogram("vllm_omni:request_stage_duration_seconds", "Seconds a finished request "
                                         "spent in each phase of the stages that profile it (--enable-ar-profiler, "
                                         "--enable-diffusion-pipeline-profiler), by its stage_durations name",
                                         ["phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.transport_drops: dict[DropKey, int] = {}  # set at each scrape; counted in the engine and the stages
        r.register(_TransportDrops(self))

    # --- request series -------------------------------------------------------
    def observe_status(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_finished(self, endpoint: str, e2e_s: float, prompt_tokens: int, generated_tokens: int,
                         stage_durations: dict[str, float] | None = None) -> None:
        self.e2e.labels(endpoint).observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        for phase, seconds in (stage_durations or {}).items():
            self.stage_durations.labels(phase).observe(seconds)

    def observe_audio(self, finished_after_s: float, audio_s: float) -> None:
        self.audio_seconds.inc(audio_s)
        if audio_s > 0:
            self.rtf.observe(finished_after_s / audio_s)

    # --- scrape ---------------------------------------------------------------
    async def render(self, engine: Any, gate: Any) -> bytes:
        self.running.set(gate.running)
        self.queued.set(gate.queued)
        await self._refresh_stages(engine)
        return generate_latest(self.registry)

    async def _refresh_stages(self, engine: Any) -> None:
        health = {h.stage_id: h for h in engine.stage_health()}
        up = [sid for sid, h in health.items() if h.state == StageState.UP]
        results = await asyncio.gather(*(asyncio.wait_for(engine.get_stage_stats(sid), STATS_TIMEOUT_S) for sid in up),
                                       return_exceptions=True)
        stats = dict(zip(up, results, strict=True))
        inboxes = {DropKey("inbox", str(sid), reason): n for sid, s in stats.items() if not isinstance(s, BaseException)
                   for reason, n in s.transport_drops.items()}
        self.transport_drops = merge_counts(engine.transport_drops(), inboxes)
        for sid, h in health.items():
            labels = (str(sid), self.stage_names.get(sid, ""))
            self.stage_up.labels(*labels).set(1.0 if h.state == StageState.UP else 0.0)
            for state in StageState:
                self.stage_replicas.labels(str(sid), state.value).set(sum(r.state == state for r in h.replicas))
            s = stats.get(sid)
            if s is None or isinstance(s, BaseException):
                if isinstance(s, BaseException):
                    logger.warning("stage %d did not report stats for /metrics: %s", sid, s)
                for gauge in (self.stage_unfinished, self.stage_queue, self.stage_batch):
                    gauge.labels(*labels).set(float("nan"))  # unknown, not zero
                continue
            self._set_stage(labels, s)

    def _set_stage(self, labels: tuple[str, str], s: Any) -> None:
        waiting = getattr(s, "num_waiting", None)
        running = getattr(s, "num_running", None)
        # Generation stages report their queue; AR stages report what they hold, all of which
        # is scheduled each step unless KV space or max_num_seqs runs out (then the split is
        # unknown here, and waiting reads 0 until the stage reports it).
        if running is None:
            running = s.num_unfinished - (waiting or 0)
        if waiting is None:
            waiting = s.num_unfinished - running
        self.stage_unfinished.labels(*labels).set(s.num_unfinished)
        self.stage_queue.labels(*labels).set(waiting)
        self.stage_batch.labels(*labels).set(running)
        if getattr(s, "diffusion_steps", None) is not None:
            self.diffusion_steps.labels(*labels).set(s.diffusion_steps)
        total = getattr(s, "kv_total_blocks", None)
        if total:
            self.stage_kv_usage.labels(*labels).set(1.0 - s.kv_free_blocks / total)


class _TransportDrops:
    """`vllm_omni:transport_dropped_total`: what the stage transport dropped (engine/transport_guard.py).
    A counter kept by the engine and the stages, exported as it was at the scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Any:
        family = CounterMetricFamily(
            "vllm_omni:transport_dropped", "Frames, connections and registrations the stage transport dropped: "
            "socket registration/outputs (the head's) or inbox (a stage's), reason undecodable, oversized, "
            "foreign_shm, handshake_failed, not_zmtp, rate_limited or replica_cap",
            labels=["socket", "stage", "reason"])
        for key, n in sorted(self._metrics.transport_drops.items()):
            family.add_metric([key.socket, key.stage, key.reason], n)
        yield family
