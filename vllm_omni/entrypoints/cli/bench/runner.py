"""Sends a benchmark's requests on vLLM's schedule and gathers their results.

Arrivals: `--request-rate inf` sends every request at once; a finite rate spaces them by a
gamma process of shape `--burstiness` (1: Poisson) and mean 1/rate, seeded by `--seed`.
`--max-concurrency` caps the requests in flight (later ones wait for a slot, so the real rate
may fall below the configured one).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import httpx

from vllm_omni.entrypoints.cli.bench.backends import REQUEST_FUNCS, RequestResult, Target
from vllm_omni.entrypoints.cli.bench.datasets import SampleRequest


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    theta = 1.0 / (rate * burstiness)
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run(backend: str, target: Target, samples: Sequence[SampleRequest], *, rate: float, burstiness: float,
              max_concurrency: int | None, seed: int, timeout_s: float) -> tuple[list[RequestResult], float]:
    """(results in send order, seconds from the first send to the last answer)."""
    request = REQUEST_FUNCS[backend]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(samples) or 1)
    offsets = arrival_offsets(len(samples), rate, burstiness, seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(sample: SampleRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if gate is None:
                return await request(client, target, sample)
            async with gate:
                return await request(client, target, sample)

        results = await asyncio.gather(*(one(s, o) for s, o in zip(samples, offsets)))
    for result, sample in zip(results, samples):
        result.prompt_tokens = result.prompt_tokens or sample.prompt_len
    return list(results), time.perf_counter() - start
