"""A server under load while a replica dies: keep requests coming, then check that each one
ended with a result or an OpenAI-shaped 503 (shared by the replica and headless-stage tests)."""
from __future__ import annotations

import asyncio

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
