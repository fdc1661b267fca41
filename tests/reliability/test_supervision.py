"""Stages come back by themselves: a stage killed (SIGKILL) or frozen (SIGSTOP) under load
fails only the requests that need it, at once (frozen: within the heartbeat deadline), is
restarted, and then serves the same outputs as before. A stage that cannot come back stays
down after its bounded attempts, and /health says why."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import pytest

from tests.pipeline.conftest import pid_alive, wait_until
from tests.reliability.conftest import NAME
from vllm_omni import AsyncOmni
from vllm_omni.entrypoints.async_omni import RequestFailedError

RECOVERY_S = 180.0  # a restart loads torch and the model again; generous for a loaded 2-core machine
SPEECH = {"model": NAME, "messages": [{"role": "user", "content": "Say it again."}], "audio": {"voice": "Ethan"}}
TEXT = {"model": NAME, "messages": [{"role": "user", "content": "Just text."}], "modalities": ["text"]}


async def _load(url: str, bodies: list[dict], until: asyncio.Event) -> list[httpx.Response]:
    """Each body sent in its own loop until `until` is set; every response is kept."""
    responses: list[httpx.Response] = []

    async def loop(body: dict) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while not until.is_set():
                responses.append(await client.post("/v1/chat/completions", json=body))

    await asyncio.gather(*(loop(b) for b in bodies))
    return responses


def _under_load(server, stage: int, sig: int, settle: float) -> tuple[list[httpx.Response], float]:
    """Signal `stage` while speech and text requests run; returns every response and the
    seconds from the signal until the stage was reported not up."""
    pid = server.proc.get("/health").json()["stages"][stage]["pid"]

    async def run() -> tuple[list[httpx.Response], float]:
        stop = asyncio.Event()
        load = asyncio.create_task(_load(server.url, [SPEECH, SPEECH, TEXT], stop))
        await asyncio.sleep(settle)  # requests in every stage
        t0 = time.monotonic()
        os.kill(pid, sig)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            while (await client.get("/health")).status_code == 200 and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
        detected = time.monotonic() - t0
        await asyncio.sleep(1.0)  # requests keep coming while it is down
        stop.set()
        return await asyncio.wait_for(load, 120), detected

    responses, detected = asyncio.run(run())
    assert wait_until(lambda: not pid_alive(pid), 10.0)  # the old process is gone (a frozen one killed)
    return responses, detected


def _check_recovery(server, stage: int, old_pid: int, speech_before: dict) -> None:
    health = server.proc.get("/health")
    if health.status_code == 503:  # still restarting: the wait is announced
        assert health.json()["stages"][stage]["state"] == "restarting"
        assert int(health.headers["retry-after"]) >= 1
        refused = server.post("/v1/chat/completions", SPEECH)
        assert refused.status_code == 503 and "restarting" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
    assert wait_until(lambda: server.proc.get("/health").status_code == 200, RECOVERY_S), server.proc.log_tail()
    assert server.proc.get("/health").json()["stages"][stage]["pid"] != old_pid
    again = server.post("/v1/chat/completions", SPEECH)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"] == speech_before["choices"][0]["message"]
    assert again.json()["choices"][1]["message"]["audio"]["data"] == speech_before["choices"][1]["message"]["audio"][
        "data"]
    server.assert_serving()


def _check_responses(responses: list[httpx.Response]) -> None:
    assert responses, "no request finished"
    for r in responses:
        assert r.status_code in (200, 503), r.text[:300]
        if r.status_code == 503:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert any(r.status_code == 503 for r in responses)  # the requests that needed the stage failed


def test_killed_talker_fails_only_speech_and_comes_back(server):
    before = server.post("/v1/chat/completions", SPEECH).json()
    old_pid = server.proc.get("/health").json()["stages"][1]["pid"]
    responses, _ = _under_load(server, 1, signal.SIGKILL, settle=1.0)
    _check_responses(responses)
    texts = [r for r in responses if r.status_code == 200 and len(r.json()["choices"]) == 1]
    assert texts  # text-only requests went on while the talker was down
    _check_recovery(server, 1, old_pid, before)


def test_frozen_thinker_is_detected_by_heartbeat_and_restarted(server):
    before = server.post("/v1/chat/completions", SPEECH).json()
    old_pid = server.proc.get("/health").json()["stages"][0]["pid"]
    responses, detected = _under_load(server, 0, signal.SIGSTOP, settle=1.0)
    # Default --omni-heartbeat-timeout is 5 s; the margin is for a loaded machine, not a target.
    assert detected < 30.0, detected
    _check_responses(responses)
    _check_recovery(server, 0, old_pid, before)


def test_a_stage_that_cannot_come_back_stays_down(toy_pipeline, tmp_path):
    """Its checkpoint disappears after start: every restart fails to load, and after
    max_stage_restarts the stage stays down, named in the reason, the others still serving."""
    talker = shutil.copytree(toy_pipeline.talker, tmp_path / "talker")
    yaml = tmp_path / "stages.yaml"
    yaml.write_text(toy_pipeline.yaml.read_text().replace(str(toy_pipeline.talker), str(talker)))
    omni = AsyncOmni(model=str(toy_pipeline.thinker), stage_configs_path=str(yaml), max_stage_restarts=1)
    try:
        shutil.rmtree(talker)
        os.kill(omni.stage_health()[1].pid, signal.SIGKILL)
        assert wait_until(lambda: omni.stage_health()[1].state.value == "restarting", 10.0)
        assert wait_until(lambda: omni.stage_health()[1].state.value == "down", RECOVERY_S)
        reason = omni.stage_health()[1].reason
        assert "not restarted: failed 2 times in a row" in reason and "initialization failed" in reason
        assert [h.state.value for h in omni.stage_health()] == ["up", "down", "up"]

        async def text_only() -> list:
            return [o async for o in omni.generate({"prompt_token_ids": [5, 6]}, modalities=["text"])]

        assert asyncio.run(text_only())[-1].finished
        with pytest.raises(RequestFailedError, match=r"stage 1 \(talker\) is down: not restarted"):
            asyncio.run(_drain(omni))
    finally:
        omni.close()


async def _drain(omni) -> list:
    return [o async for o in omni.generate({"prompt_token_ids": [5, 6]})]
