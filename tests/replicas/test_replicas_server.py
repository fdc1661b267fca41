"""A real `vllm-omni serve` of the tiny Qwen2.5-Omni with two talker replicas: /health and
/metrics show the replicas; one replica SIGKILLed (its pid read from /health) under load
while the other serves: every request ends with a result or an OpenAI-shaped error, the
server stays healthy, new requests go to the live replica, and the killed one comes back
and gets work again."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import in_threads
from tests.pipeline.conftest import pid_alive, wait_until
from tests.server.under_load import assert_each_ended, kill_replica_under_load
from tests.reliability.conftest import NAME, OVERRIDES, Server, launch, stop_cleanly

RECOVERY_S = 180.0
TALKER = 1
SPEECH = {"model": NAME, "messages": [{"role": "user", "content": "Say it again."}], "audio": {"voice": "Ethan"}}


@pytest.fixture(scope="module")
def server(fault_model, tmp_path_factory):
    # The bundled config puts the talker on device 1: two replicas need two devices (spec 002
    # pool mode; on this CPU machine they are only names). The talker replicas, which these
    # tests kill, are processes; the thinker and code2wav run as threads of the server.
    talker = {**OVERRIDES["1"], "num_replicas": 2, "devices": "1,2"}
    overrides = {**in_threads(1, OVERRIDES), "1": talker, "2": {"process": False}}
    proc = launch(tmp_path_factory.mktemp("replicas-server"), fault_model, "--omni-lb-policy", "round-robin",
                  overrides=overrides)
    try:
        yield Server(proc.wait_ready())
    finally:
        try:
            proc.stage_pids += [r["pid"] for s in proc.get("/health", timeout=5.0).json()["stages"]
                                for r in s["replicas"]]
        except httpx.HTTPError:
            pass  # not answering: the pids it started with are still checked
        stop_cleanly(proc)


def talker_replicas(server) -> list[dict]:
    return server.proc.get("/health").json()["stages"][TALKER]["replicas"]


def replica_gauge(server, state: str) -> float | None:
    return server.proc.metric("vllm_omni:stage_replicas", stage=str(TALKER), state=state)


def test_health_and_metrics_show_the_replicas(server):
    body = server.proc.get("/health").json()
    assert [len(s["replicas"]) for s in body["stages"]] == [1, 2, 1]
    replicas = body["stages"][TALKER]["replicas"]
    assert [(r["replica"], r["state"]) for r in replicas] == [(0, "up"), (1, "up")]
    assert replicas[0]["pid"] != replicas[1]["pid"] and body["stages"][TALKER]["pid"] == replicas[0]["pid"]
    assert (replica_gauge(server, "up"), replica_gauge(server, "down")) == (2.0, 0.0)
    before = [r["routed"] for r in replicas]
    for _ in range(2):
        assert server.post("/v1/chat/completions", SPEECH).status_code == 200
    assert [r["routed"] - b for r, b in zip(talker_replicas(server), before)] == [1, 1]  # round robin


def test_a_killed_replica_under_load_and_its_return(server):
    before = server.post("/v1/chat/completions", SPEECH).json()
    victim = talker_replicas(server)[0]

    def check_health(health: httpx.Response) -> None:
        # One replica down is not an unhealthy server: the stage still serves.
        assert health.status_code == 200 and health.json()["stages"][TALKER]["state"] == "up"

    responses = asyncio.run(kill_replica_under_load(server.url, SPEECH, TALKER, victim["pid"], 30, check_health))
    assert_each_ended(responses, "replica 0 is down")
    assert wait_until(lambda: not pid_alive(victim["pid"]), 10.0)

    assert wait_until(lambda: talker_replicas(server)[0]["state"] == "up", RECOVERY_S), server.proc.log_tail()
    back = talker_replicas(server)
    assert back[0]["pid"] != victim["pid"] and replica_gauge(server, "up") == 2.0
    routed = back[0]["routed"]
    for _ in range(2):
        again = server.post("/v1/chat/completions", SPEECH)
        assert again.status_code == 200
        assert again.json()["choices"][0]["message"] == before["choices"][0]["message"]
    assert talker_replicas(server)[0]["routed"] == routed + 1  # back in the rotation
    assert again.json()["choices"][1]["message"]["audio"]["data"] == before["choices"][1]["message"]["audio"]["data"]
    server.assert_serving()
