"""The figures of a benchmark run, computed from each request's client-side timings.

Latencies follow vLLM's benchmark client: TTFT (first text delta), TPOT ((last text - first
text) / (output tokens - 1)), ITL (gaps between text deltas), E2EL (request sent to response
complete); audio as upstream vLLM-Omni's omni client adds: TTFP (first audio packet), RTF
(time of the last audio packet / seconds of audio), audio duration.

Playback (what a listener hears): a client starts playing at the first audio chunk and plays
chunks back to back; a chunk that arrives after everything before it has played is an
*underrun*, and the silence until it arrives a *gap* (the worst one is reported). Playback
resumes with that chunk.

Warm-up: the first `warmup` requests sent (first-request costs: graph captures, caches) are
summarised apart and left out of the latency percentiles; throughputs count every request over
the whole run, as vLLM's client does. sustained.py says what a run must hold to measure
sustained load; benchmarks/bench_tts.py and bench_omni_e2e.py compute their figures here too.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_omni.entrypoints.cli.bench.backends import RequestResult

# metric -> (header, unit): what --percentile-metrics may name
METRICS = {"ttft": ("Time to First Token", "ms"), "tpot": ("Time per Output Token (excl. 1st token)", "ms"),
           "itl": ("Inter-token Latency", "ms"), "e2el": ("End-to-end Latency", "ms"),
           "audio_ttfp": ("Time to First Packet", "ms"), "audio_rtf": ("Real Time Factor", ""),
           "audio_duration": ("Audio Duration", "s")}


@dataclass(frozen=True)
class Playback:
    underruns: int
    worst_gap: float  # s, 0 without underruns
    # Which chunks came late (0: the first), with their gaps: a ramp's join or a steady chunk.
    late: tuple[tuple[int, float], ...] = field(default=(), compare=False)


def playback(chunks: Sequence[tuple[float, float]]) -> Playback:
    """Underruns of a listener that starts at the first chunk: (arrival s, seconds) per chunk."""
    late, played_until = [], None
    for index, (arrival, seconds) in enumerate(chunks):
        if played_until is not None and arrival > played_until:
            late.append((index, arrival - played_until))
        played_until = max(played_until if played_until is not None else arrival, arrival) + seconds
    return Playback(len(late), max((gap for _, gap in late), default=0.0), tuple(late))


def warmup_count(num_requests: int, fraction: float) -> int:
    return min(num_requests, math.ceil(num_requests * fraction)) if fraction > 0 else 0


def samples(results: Sequence[RequestResult], metric: str) -> list[float]:
    """One metric's values over the successful requests, in its unit (ms, s or a ratio)."""
    ok = [r for r in results if r.success]
    if metric == "ttft":
        values = [r.ttft for r in ok if r.ttft is not None]
    elif metric == "tpot":
        values = [(r.text_latency - r.ttft) / (r.output_tokens - 1) for r in ok
                  if r.ttft is not None and r.output_tokens > 1]
    elif metric == "itl":
        values = [gap for r in ok for gap in r.itl]
    elif metric == "e2el":
        values = [r.latency for r in ok]
    elif metric == "audio_ttfp":
        values = [r.audio_chunks[0][0] for r in ok if r.audio_chunks]
    elif metric == "audio_rtf":
        return [r.audio_chunks[-1][0] / r.audio_seconds for r in ok if r.audio_seconds > 0]
    elif metric == "audio_duration":
        return [r.audio_seconds for r in ok if r.audio_chunks]
    else:
        raise ValueError(f"unknown metric {metric!r}; allowed: {', '.join(METRICS)}")
    return [v * 1000.0 for v in values]


@dataclass(frozen=True)
class Summary:
    mean: float
    median: float
    std: float
    max: float
    percentiles: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float]) -> Summary | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(a.std()), float(a.max()),
                   tuple((p, float(np.percentile(a, p))) for p in percentiles))


@dataclass(frozen=True)
class RunMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    audio_seconds: float
    peak_concurrency: int
    underruns: int
    requests_with_underruns: int
    worst_gap: float  # s

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration if self.duration else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output / self.duration if self.duration else 0.0

    @property
    def audio_throughput(self) -> float:
        return self.audio_seconds / self.duration if self.duration else 0.0


def run_metrics(results: Sequence[RequestResult], duration: float) -> RunMetrics:
    ok = [r for r in results if r.success]
    plays = [playback(r.audio_chunks) for r in ok if r.audio_chunks]
    return RunMetrics(completed=len(ok), failed=len(results) - len(ok), duration=duration,
                      total_input=sum(r.prompt_tokens for r in ok), total_output=sum(r.output_tokens for r in ok),
                      audio_seconds=sum(r.audio_seconds for r in ok), peak_concurrency=_peak(ok),
                      underruns=sum(p.underruns for p in plays),
                      requests_with_underruns=sum(1 for p in plays if p.underruns),
                      worst_gap=max((p.worst_gap for p in plays), default=0.0))


def _peak(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once (from their start and end times)."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    peak = live = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak
