"""What makes a benchmark run measure sustained load rather than a burst (issue 44):

- a closed-loop run (at most C requests in flight) sends at least 4 x C requests, so most of it
  runs with C in flight, not while the first C start and the last ones drain;
- an open-loop run (arrivals at a rate R) has at least 30 s of arrivals (30 x R requests), so a
  backlog that grows (arrivals faster than the pipeline) shows up instead of draining after;
- the first 10% of the requests (rounded up) are warm-up, reported apart (metrics.warmup_count).

`vllm bench serve` keeps upstream's request count and says when a run is not sustained; the
project's benchmark scripts (benchmarks/bench_tts.py, bench_omni_e2e.py) raise the count.
"""
from __future__ import annotations

import math

MIN_REQUESTS_PER_CONCURRENCY = 4
MIN_ARRIVAL_S = 30.0
WARMUP_FRACTION = 0.1


def sustained_count(num_requests: int, *, concurrency: int | None = None, rate: float | None = None) -> int:
    """The fewest requests a sustained run of this shape sends (at least `num_requests`).
    `rate` None or inf: closed loop (or all at once); else open loop at that rate."""
    needed = num_requests
    if concurrency is not None:
        needed = max(needed, MIN_REQUESTS_PER_CONCURRENCY * concurrency)
    if rate is not None and math.isfinite(rate):
        needed = max(needed, math.ceil(MIN_ARRIVAL_S * rate))
    return needed


def why_short(num_requests: int, *, concurrency: int | None = None, rate: float | None = None) -> str | None:
    """Why a run of `num_requests` is not sustained (None: it is)."""
    needed = sustained_count(num_requests, concurrency=concurrency, rate=rate)
    if needed == num_requests:
        return None
    if rate is not None and math.isfinite(rate) and needed == math.ceil(MIN_ARRIVAL_S * rate):
        return (f"{num_requests} requests at {rate:g}/s arrive within {num_requests / rate:.1f} s, under "
                f"{MIN_ARRIVAL_S:g} s of sustained arrivals: {needed} needed")
    return (f"{num_requests} requests at {concurrency} in flight: under {MIN_REQUESTS_PER_CONCURRENCY} x the "
            f"concurrency, {needed} needed")
