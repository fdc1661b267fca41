"""A server under load while a replica dies: keep requests coming, then check that each one
ended with a result or an OpenAI-shaped 503 (shared by the replica and headless-stage tests)."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import httpx


async def post_until(url: str, body: dict, until: asyncio.Event, streams: int) -> list[httpx.Response]:
    """`streams` clients each posting `body` to /v1/chat/completions until `until` is set."""
    responses: list[httpx.Response] = []

    async def loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while not until.is_set():
                responses.append(await client.post("/v1/chat/completions", json=body))

    await asyncio.gather(*(loop() for _ in range(streams)))
    return responses


def assert_each_ended(responses: list[httpx.Response], down_message: str) -> None:
    """A result or an error, never a hang; errors name the down replica; most requests succeed."""
    assert responses
    for r in responses:
        assert r.status_code in (200, 503), r.text[:300]
        if r.status_code == 503:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert down_message in r.json()["error"]["message"]
    assert sum(r.status_code == 200 for r in responses) > len(responses) // 2


async def kill_replica_under_load(url: str, body: dict, stage_id: int, pid: int, down_within_s: float,
                                  check_health: Callable[[httpx.Response], None]) -> list[httpx.Response]:
    """Four clients post `body`; once requests are in both replicas, SIGKILL `pid` (replica 0 of
    stage `stage_id`), wait (at most `down_within_s`) until /health shows it not up, hand that
    /health response to `check_health`, keep the load on 2 s more, then return every response."""
    stop = asyncio.Event()
    load = asyncio.create_task(post_until(url, body, stop, streams=4))
    await asyncio.sleep(1.5)  # requests in both replicas
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while (await client.get("/health")).json()["stages"][stage_id]["replicas"][0]["state"] == "up":
            assert time.monotonic() - t0 < down_within_s
            await asyncio.sleep(0.05)
        check_health(await client.get("/health"))
    await asyncio.sleep(2.0)  # requests keep coming while it is down: all go to replica 1
    stop.set()
    return await asyncio.wait_for(load, 120)
