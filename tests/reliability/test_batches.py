"""Batches through the real server: 32 concurrent requests of mixed lengths and kinds each
equal their solo run, and a bad request among them (an out-of-vocabulary token id) fails
alone without touching its batch mates."""
from __future__ import annotations

import asyncio

import httpx

from tests.reliability.conftest import NAME

WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch".split()


def _requests() -> list[tuple[str, dict]]:
    """32 requests: chat text, chat text + speech, completions from text and from token ids;
    prompts of 1 to ~200 words, 1 to 64 new tokens."""
    out = []
    for i in range(32):
        text = " ".join(WORDS[(i * j) % len(WORDS)] for j in range(1 + (i * 37) % 200))
        max_tokens = 1 + (i * 13) % 64
        kind = i % 4
        if kind == 0:
            out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                 "modalities": ["text"], "max_tokens": max_tokens}))
        elif kind == 1:
            out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                 "audio": {"voice": "Chelsie" if i % 8 == 1 else "Ethan"},
                                                 "max_tokens": min(max_tokens, 8)}))
        elif kind == 2:
            out.append(("/v1/completions", {"prompt": text, "max_tokens": max_tokens}))
        else:
            out.append(("/v1/completions", {"prompt": [5 + (i * k) % 300 for k in range(1 + i * 5)],
                                            "max_tokens": max_tokens, "ignore_eos": True}))
    return out


def _result(r: httpx.Response) -> list:
    """What must not depend on batching: texts, speech samples, finish reasons, token counts
    (not the per-response ids and timestamps)."""
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    choices = []
    for c in body["choices"]:
        message = c.get("message") or {}
        audio = message.get("audio") or {}
        choices.append((c.get("text"), message.get("content"), audio.get("data"), audio.get("transcript"),
                        c["finish_reason"]))
    return [choices, body["usage"]]


async def _send_all(url: str, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        return await asyncio.gather(*(client.post(path, json={"model": NAME, **body}) for path, body in requests))


def test_32_concurrent_mixed_requests_equal_their_solo_runs(server):
    requests = _requests()
    solo = [_result(server.post(path, {"model": NAME, **body})) for path, body in requests]
    together = [_result(r) for r in asyncio.run(_send_all(server.url, requests))]
    for i, (one, many) in enumerate(zip(solo, together, strict=True)):
        assert many == one, f"request {i} ({requests[i][0]}) differs when batched"
    server.assert_serving()


def test_an_out_of_vocabulary_prompt_fails_alone_in_a_batch(server):
    good = [("/v1/completions", {"prompt": [7, 8, 9 + i], "max_tokens": 16, "ignore_eos": True}) for i in range(6)]
    bad = ("/v1/completions", {"prompt": [7, 8, 10**6], "max_tokens": 16})
    solo = [_result(server.post(path, {"model": NAME, **body})) for path, body in good]
    responses = asyncio.run(_send_all(server.url, good[:3] + [bad] + good[3:]))
    assert responses[3].status_code == 400 and responses[3].json()["error"]["param"] == "prompt"
    assert [_result(r) for r in responses[:3] + responses[4:]] == solo
