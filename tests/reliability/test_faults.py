"""A failure at any hop between admission and the stage ends that request with an error and
frees its admission slot; requests running beside it are unaffected (faults.py injects them)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import NAME

HOPS = {  # voice -> what the error names
    "FaultBridge": "injected: the bridge failed",
    "FaultEncode": "cannot send the request: OverflowError",
    "FaultSend": "cannot send the request: NotImplementedError",
    "FaultStep": "the engine step failed for this request",
}


def speech_error(response: httpx.Response) -> dict:
    """The error that ended the speech: the whole response's (a 500) when it failed before the
    text was complete, else the audio choice's in a partial 200 (serving_chat.py)."""
    if response.status_code == 500:
        return response.json()["error"]
    assert response.status_code == 200, response.text
    text, speech = response.json()["choices"]
    assert text["message"]["content"] and speech["finish_reason"] == "error", response.text
    return speech["error"]


@pytest.mark.parametrize("voice", list(HOPS))
def test_a_fault_fails_its_request_alone(server, voice):
    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            def chat(v: str, text: str):
                return client.post("/v1/chat/completions", json={
                    "model": NAME, "messages": [{"role": "user", "content": text}], "audio": {"voice": v}})
            return await asyncio.gather(chat("Ethan", "first neighbour"), chat(voice, "faulty"),
                                        chat("Chelsie", "second neighbour"))

    before, bad, after = asyncio.run(together())
    error = speech_error(bad)
    assert error["type"] == "InternalServerError" and HOPS[voice] in error["message"], error
    for ok in (before, after):
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][1]["message"]["audio"]["data"]
    server.assert_serving()


def test_a_fault_in_a_stream_ends_it_in_band(server):
    r = server.post("/v1/chat/completions", {"model": NAME, "stream": True, "audio": {"voice": "FaultStep"},
                                             "messages": [{"role": "user", "content": "stream and fail"}]})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"error"' in events[-2] and HOPS["FaultStep"] in events[-2]
    server.assert_serving()
