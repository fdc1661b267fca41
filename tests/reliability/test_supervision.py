"""Stages come back by themselves: a stage killed (SIGKILL) or frozen (SIGSTOP) under load
fails only the requests that need it, at once (frozen: within the heartbeat deadline), is
restarted, and then serves the same outputs as before. A stage that cannot come back stays
down after its bounded attempts, and says why."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx

from tests.pipeline.conftest import pid_alive, wait_until
from tests.reliability.conftest import NAME
from vllm_omni.engine.supervisor import StageSupervisor

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


def test_a_stage_that_cannot_come_back_stays_down(tiny_model, tmp_path):
    """Its checkpoint disappears after start: every restart fails to load, and after
    max_stage_restarts the stage stays down, with the reason; requests fail at once."""
    from vllm_omni.config import single_stage_pipeline
    from vllm_omni.engine.orchestrator import RuntimeOptions
    from vllm_omni.engine.runtime import OmniRuntime

    model = shutil.copytree(tiny_model("qwen3"), tmp_path / "model")
    runtime = OmniRuntime(single_stage_pipeline(str(model)), str(model), RuntimeOptions(max_stage_restarts=1))
    try:
        shutil.rmtree(model)
        os.kill(runtime.health()[0].pid, signal.SIGKILL)
        assert wait_until(lambda: runtime.health()[0].state.value == "restarting", 10.0)
        assert runtime.health()[0].retry_after_s is not None
        assert wait_until(lambda: runtime.health()[0].state.value == "down", RECOVERY_S)
        reason = runtime.health()[0].reason
        assert "not restarted: failed 2 times in a row" in reason and "initialization failed" in reason
    finally:
        runtime.close()


# ------------------------------------------------------------------ the policy (asyncio, no processes)


def test_backoff_doubles_attempts_are_bounded_and_a_stable_stage_starts_over():
    async def run() -> None:
        attempts: list[float] = []

        async def restart(stage_id: int) -> None:
            attempts.append(time.monotonic())
            raise RuntimeError("still broken")

        sup = StageSupervisor(restart, max_restarts=3, backoff_s=0.05, stable_after_s=0.3)
        sup.started(0, startup_s=2.0)
        sup.on_down(0, "killed")
        await asyncio.sleep(0.01)
        assert sup.restarting(0) and 2.0 <= sup.retry_after(0) <= 2.05
        while sup.restarting(0):
            await asyncio.sleep(0.01)
        gaps = [b - a for a, b in zip(attempts, attempts[1:])]
        assert len(attempts) == 3 and gaps[0] >= 0.1 and gaps[1] >= 0.2  # 0.05, 0.1, 0.2 s
        assert "failed 4 times in a row" in sup.gave_up(0) and sup.retry_after(0) is None

        async def restart_ok(stage_id: int) -> None:
            sup2.started(stage_id, 0.01)  # as the orchestrator reports a stage that came back

        sup2 = StageSupervisor(restart_ok, max_restarts=1, backoff_s=0.01, stable_after_s=0.3)
        sup2.started(1, 1.0)
        sup2.on_down(1, "crash")  # failure 1: restarted
        await asyncio.sleep(0.1)
        assert not sup2.restarting(1) and sup2.gave_up(1) is None
        await asyncio.sleep(0.35)  # served long enough: the next crash is a new incident
        sup2.on_down(1, "crash")
        await asyncio.sleep(0.1)
        assert sup2.gave_up(1) is None
        sup2.on_down(1, "crash again")  # right after a restart: failure 2 of a budget of 1
        await asyncio.sleep(0.05)
        assert "failed 2 times in a row" in sup2.gave_up(1)
        await sup.close()
        await sup2.close()

    asyncio.run(run())
