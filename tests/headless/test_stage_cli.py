"""The stage-based CLI end to end: a head (`vllm-omni serve MODEL --stage-id 0 -oma A -omp P`, with
the API server) and headless stages (`--headless --stage-id N`) as separate processes on loopback,
the tiny Qwen2.5-Omni pipeline, a real HTTP client against the head.

One deployment serves the module's tests in order (the package's cluster, conftest.py: stage 2
starts before the head and stage 1 after it, all with the cluster secret; test_secure_cluster.py
uses it first, as started): the answers equal a one-process server's; a second stage-1 replica attaches at run time
and gets requests; a headless replica SIGKILLed under load (every request ends 200 or 503, /health
shows it down) and started again attaches into its slot and serves; a stage whose model differs is
refused; Ctrl-C on a headless process and on the head stop everything cleanly.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import in_threads
from tests.headless.conftest import (
    HEARTBEAT_TIMEOUT_S, NAME, OVERRIDES, READY_S, SPEECH, TEXT, Headless, answer, head_args, stage,
)
from tests.pipeline.conftest import pid_alive, wait_until
from tests.server.under_load import assert_each_ended, kill_replica_under_load
from tests.server.conftest import ServerProcess, free_port


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("qwen2_5_omni")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[str, tuple]:
    """The same requests on the one-process deployment (every stage a thread of the server)."""
    tmp = tmp_path_factory.mktemp("one-process")
    proc = ServerProcess.launch([str(model), "--served-model-name", NAME, "--stage-overrides",
                                 json.dumps(in_threads(3, OVERRIDES))], tmp / "server.log")
    try:
        proc.wait_ready(READY_S)
        return {"speech": answer(proc, SPEECH), "text": answer(proc, TEXT)}
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(headless_cluster, reference):
    """The package's cluster as started (test_secure_cluster.py leaves it so); these tests change it."""
    c = headless_cluster.get(pristine=True)
    c.changed = True
    return c


def test_head_and_headless_stages_serve_like_one_process(cluster, reference):
    head = cluster.head
    health = head.get("/health").json()["stages"]
    assert [(s["stage_id"], s["state"], len(s["replicas"])) for s in health] == [(0, "up", 1), (1, "up", 1),
                                                                                 (2, "up", 1)]
    # Stages 1 and 2 are the headless processes' children, not the head's.
    head_children = {int(p) for task in Path(f"/proc/{head.proc.pid}/task").iterdir()
                     for p in (task / "children").read_text().split()}
    assert health[0]["pid"] in head_children and not {health[1]["pid"], health[2]["pid"]} & head_children
    assert answer(head, SPEECH) == reference["speech"]
    assert answer(head, TEXT) == reference["text"]
    # Engine flags apply to the stage of the process that got them (the stages report when they are UP).
    log = head.log_path.read_text()
    assert "stage 0 (thinker) is UP" in log and "'max_model_len': 1024" in log
    assert "stage 1 (talker) replica 0 is UP" in log and "'max_model_len': 512" in log


def test_a_second_replica_attaches_at_run_time(cluster, reference):
    head = cluster.head
    cluster.start_headless(1)
    assert wait_until(lambda: [r["state"] for r in stage(head, 1)["replicas"]] == ["up", "up"], READY_S), \
        head.log_tail()
    before = [r["routed"] for r in stage(head, 1)["replicas"]]
    for _ in range(4):
        assert answer(head, SPEECH) == reference["speech"]
    assert [r["routed"] - b for r, b in zip(stage(head, 1)["replicas"], before)] == [2, 2]  # round robin


def test_a_killed_headless_replica_under_load_and_its_restart(cluster, reference):
    head = cluster.head
    victim = stage(head, 1)["replicas"][0]
    owner = next(h for h in cluster.headless if h.proc.poll() is None and f"pids [{victim['pid']}]" in h.text())

    def check_health(response: httpx.Response) -> None:
        # Found by the missed heartbeats; not restarted by the head; the stage serves on replica 1.
        health = response.json()
        assert health["stages"][1]["state"] == "up"
        assert health["stages"][1]["replicas"][0]["state"] == "down"
        assert "no heartbeat" in health["stages"][1]["replicas"][0]["reason"]

    responses = asyncio.run(kill_replica_under_load(head.url, SPEECH, 1, victim["pid"], HEARTBEAT_TIMEOUT_S + 20,
                                                    check_health))
    assert_each_ended(responses, "replica 0 is down")
    assert owner.wait(30) == 1  # its only replica died: the headless process exits, for its operator to restart
    assert "killed by SIGKILL" in owner.text() and "Traceback" not in owner.text()
    assert stage(head, 1)["replicas"][0]["state"] == "down"  # the head restarts nothing

    cluster.start_headless(1)  # the operator starts it again: it takes the down replica's slot
    assert wait_until(lambda: stage(head, 1)["replicas"][0]["state"] == "up", READY_S), head.log_tail()
    replicas = stage(head, 1)["replicas"]
    assert len(replicas) == 2 and replicas[0]["pid"] != victim["pid"]
    routed = replicas[0]["routed"]
    for _ in range(2):
        assert answer(head, SPEECH) == reference["speech"]
    assert stage(head, 1)["replicas"][0]["routed"] == routed + 1  # back in the rotation


def test_a_stage_of_another_model_is_refused(cluster, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(cluster.model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_name_or_path": "another-checkpoint"}))
    refused = Headless(other, 1, cluster.master_port, tmp_path / "refused.log", *cluster.secret)
    try:
        assert refused.wait(READY_S) == 1
    finally:
        refused.kill()
    assert "refused stage 1: its pipeline config differs from the head's" in refused.text()
    assert "Traceback" not in refused.text()
    assert "refused a headless stage 1" in cluster.head.log_path.read_text()
    assert len(stage(cluster.head, 1)["replicas"]) == 2


def test_ctrl_c_stops_a_headless_stage_and_then_the_head(cluster):
    head = cluster.head
    second = next(h for h in cluster.headless if h.proc.poll() is None
                  and f"pids [{stage(head, 1)['replicas'][1]['pid']}]" in h.text())
    second.proc.send_signal(signal.SIGINT)
    assert second.wait(30) == 0 and "Traceback" not in second.text()
    # It said goodbye: down at once, not after the heartbeat deadline.
    assert wait_until(lambda: stage(head, 1)["replicas"][1]["state"] == "down", 10.0)
    assert "left" in stage(head, 1)["replicas"][1]["reason"]
    assert answer(head, TEXT)  # still serving

    alive = [h for h in cluster.headless if h.proc.poll() is None]
    pids = [r["pid"] for s in head.get("/health").json()["stages"] for r in s["replicas"] if r["state"] == "up"]
    head.proc.send_signal(signal.SIGINT)
    assert head.proc.wait(60) == 0, head.log_tail()
    for h in alive:  # the head sent them Shutdown: they exit 0
        assert h.wait(30) == 0, h.text()[-2000:]
        assert "Traceback" not in h.text()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10.0)
    assert "Traceback" not in head.log_path.read_text()


def test_a_headless_stage_exits_when_its_head_dies(model, tmp_path):
    """A head killed outright (no Shutdown sent): its headless stage stops hearing from it and exits
    with a log line, within the heartbeat timeout. (This head never gets its stage 1; its stage 0
    runs as a thread of the head: what dies here is the head's process.)"""
    port = free_port()
    overrides = ("--stage-overrides", json.dumps(in_threads(1, OVERRIDES)))  # the same on both sides
    stage2 = Headless(model, 2, port, tmp_path / "stage2.log", *overrides)
    head = ServerProcess.launch(head_args(model, port, "--stage-id", "0", "--omni-heartbeat-timeout",
                                          str(HEARTBEAT_TIMEOUT_S), *overrides), tmp_path / "head.log")
    try:
        assert wait_until(lambda: "stage 2 (code2wav) replica 0 is UP" in head.log_path.read_text()
                          or stage2.proc.poll() is not None, READY_S, interval_s=0.2), head.log_tail()
        os.killpg(head.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert stage2.wait(HEARTBEAT_TIMEOUT_S + 30) == 1
        assert time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S + 30
        assert f"the head at tcp://127.0.0.1:{port} did not answer" in stage2.text()
        assert "Traceback" not in stage2.text()
    finally:
        stage2.kill()
        head.stop()
