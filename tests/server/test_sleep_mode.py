"""--enable-sleep-mode and --enable-ar-profiler on a real `vllm-omni serve` of the demo model (thinker,
talker, token2wav; CPU): vLLM's /sleep, /wake_up and /is_sleeping, requests while asleep, outputs
after waking equal those before, and the AR stages' durations in responses and /metrics."""
from __future__ import annotations

import base64
import json
import time

import httpx
import openai
import pytest

from tests.conftest import in_threads
from tests.server.conftest import ServerProcess
from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME

CHAT = {"model": DEMO_SERVED_NAME, "max_tokens": 6, "temperature": 0.0, "seed": 7,
        "messages": [{"role": "user", "content": "Say something."}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sleep-server")
    # The thinker's cap (the demo's max_tokens_limit 256) raised: one request runs long enough to
    # be in flight when /sleep comes (test_sleep_is_refused_while_a_request_runs).
    # The stages run as threads of the server (the same stage loop, messages and heartbeats as a
    # stage process): nothing here is about stage processes.
    overrides = in_threads(3, {"0": {"max_tokens_limit": 3000}, "1": {"default_sampling_params": {"max_tokens": 24}}})
    srv = ServerProcess.launch(["--enable-sleep-mode", "--enable-ar-profiler",
                                "--stage-overrides", json.dumps(overrides)],
                               tmp / "server.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _chat(server: ServerProcess, **changes) -> dict:
    r = server.post("/v1/chat/completions", {**CHAT, **changes}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(body: dict) -> tuple[str, bytes]:
    """The text and the speech (the WAV's bytes) of a greedy chat answer."""
    return body["choices"][0]["message"]["content"], base64.b64decode(body["choices"][1]["message"]["audio"]["data"])


def test_the_ar_profiler_reports_each_stage_in_the_response_and_metrics(server):
    durations = _chat(server)["metrics"]["stage_durations"]
    for stage in (0, 1):  # the thinker and the talker are AR stages: queue, prefill, decode
        assert all(durations[f"ar_stage_{stage}{part}"] >= 0 for part in ("", ".queue", ".prefill", ".decode"))
        assert durations[f"ar_stage_{stage}"] >= durations[f"ar_stage_{stage}.prefill"] > 0
    assert durations["ar_stage_2"] > 0  # token2wav, a generation stage: its time in the stage
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    text_only = client.chat.completions.create(**{**CHAT, "modalities": ["text"]})
    assert set(text_only.model_extra["metrics"]["stage_durations"]) == {
        "ar_stage_0", "ar_stage_0.queue", "ar_stage_0.prefill", "ar_stage_0.decode"}
    assert server.metric("vllm_omni:request_stage_duration_seconds_count", phase="ar_stage_1.decode") >= 1


def test_completions_and_streams_carry_the_durations_too(server):
    body = server.post("/v1/completions", {"model": DEMO_SERVED_NAME, "prompt": ["Hi", "Bye"], "max_tokens": 3}).json()
    assert [set(c["metrics"]["stage_durations"]) >= {"ar_stage_0", "ar_stage_0.decode"} for c in body["choices"]] == [
        True, True]  # each prompt is a request of its own
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**CHAT, "modalities": ["text"], "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and "ar_stage_0.prefill" in chunks[-1]["metrics"]["stage_durations"]


def test_sleep_and_wake_up_at_both_levels(server):
    before = _answer(_chat(server))
    for level, wake in ((1, [None]), (2, [["weights"], ["kv_cache"]])):
        assert server.get("/is_sleeping").json() == {"is_sleeping": False}
        r = httpx.post(f"{server.url}/sleep", params={"level": level}, timeout=120)
        assert r.status_code == 200 and r.content == b""
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep = server.post("/v1/chat/completions", CHAT)
        assert asleep.status_code == 503 and "sleeping" in asleep.json()["error"]["message"]
        if level == 1:  # past the heartbeat timeout (3 s): a sleeping stage still beats, it is not down
            time.sleep(3.5)
        assert server.get("/health").status_code == 200
        for tags in wake:  # level 2 wakes the weights, then the KV cache (vLLM's tags)
            assert httpx.post(f"{server.url}/wake_up", params={"tags": tags} if tags else None,
                              timeout=120).status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": False}
        assert server.get("/health").status_code == 200
        assert _answer(_chat(server)) == before, f"level {level}"


def test_sleep_is_refused_while_a_request_runs(server):
    long = {**CHAT, "modalities": ["text"], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=long, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # (kept: a dropped iterator closes the stream)
        assert next(lines).startswith("data: ")  # it runs
        r = httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60)
        assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
    # Leaving the stream aborts the request; the server never slept and serves on.
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _chat(server, modalities=["text"])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, params, param", [("/sleep", {"level": 3}, "level"),
                                                 ("/wake_up", {"tags": "gpu"}, "tags")])
def test_bad_levels_and_tags_are_400(server, path, params, param):
    r = httpx.post(f"{server.url}{path}", params=params, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
