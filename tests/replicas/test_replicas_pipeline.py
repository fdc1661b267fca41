"""Two talker replicas in the toy three-stage pipeline (real processes): outputs equal the
models run by hand (so equal to one replica, greedy), both replicas serve, a replica killed
while it holds requests hands them to the other (nothing of them had reached the caller: the
talker answers only when done) and comes back, and a frozen replica misses its heartbeat, is
marked down, gets no new work, and is restarted. The talker replicas, which the tests kill and
freeze, are processes; stages 0 and 2 run as threads."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.pipeline.conftest import assert_matches, pid_alive, random_prompts, run_reference, wait_until
from tests.pipeline.test_pipeline_e2e import group
from vllm_omni import Omni

RECOVERY_S = 180.0  # a restart imports torch and loads the model again on a loaded 2-core machine
TALKER = 1


@pytest.fixture(scope="module")
def omni(toy_pipeline):
    # Long talker outputs (the long config has room for them) keep requests in a replica long
    # enough to kill it while it holds some.
    talker = {"num_replicas": 2, "default_sampling_params": {"max_tokens": 120}}
    overrides = {"0": {"process": False}, str(TALKER): talker, "2": {"process": False}}
    with Omni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.long_yaml),
              stage_overrides=overrides, lb_policy="round-robin", heartbeat_timeout=2.0) as omni:
        yield omni


def replicas(omni) -> list:
    return list(omni.stage_health()[TALKER].replicas)


def generate_checked(omni, prompts: list[list[int]]) -> None:
    outputs = omni.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for outs, ref in zip(group(outputs), run_reference(omni.pipeline, prompts), strict=True):
        assert_matches(outs, ref)


def test_two_talker_replicas_equal_the_models_run_by_hand(omni):
    health = omni.stage_health()
    assert [len(h.replicas) for h in health] == [1, 2, 1]
    pids = {r.pid for r in replicas(omni)}
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    routed = [r.routed for r in replicas(omni)]
    generate_checked(omni, random_prompts(8, seed=5))
    assert [r.routed - before for r, before in zip(replicas(omni), routed)] == [4, 4]  # round robin
    assert [r.queue for r in replicas(omni)] == [0, 0]  # every routed request was released


def test_a_killed_replica_hands_its_requests_over_and_comes_back(omni):
    counters = omni._runtime.orchestrator.stage_counters[TALKER]
    moved = counters["moved_to_another_replica"]
    victim = replicas(omni)[0]
    prompts = random_prompts(12, seed=9)
    killed = threading.Event()

    def kill_when_busy() -> None:
        if wait_until(lambda: replicas(omni)[0].queue >= 2, 60.0, interval_s=0.005):
            os.kill(victim.pid, signal.SIGKILL)
            killed.set()

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    generate_checked(omni, prompts)  # every request still equals its solo run
    killer.join()
    assert killed.is_set()
    assert counters["moved_to_another_replica"] >= moved + 2
    assert not pid_alive(victim.pid)
    assert wait_until(lambda: replicas(omni)[0].state.value == "up", RECOVERY_S), replicas(omni)
    assert replicas(omni)[0].pid != victim.pid
    before = replicas(omni)[0].routed
    generate_checked(omni, random_prompts(2, seed=11))
    assert replicas(omni)[0].routed == before + 1  # back in the rotation


def test_a_frozen_replica_misses_its_heartbeat_gets_no_work_and_is_restarted(omni):
    frozen = replicas(omni)[1]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: replicas(omni)[1].state.value != "up", 30.0)
        state = replicas(omni)[1]
        assert state.state.value in ("down", "restarting") and "no heartbeat" in state.reason
        assert omni.stage_health()[TALKER].state.value == "up"  # the stage still serves
        routed = replicas(omni)[1].routed
        generate_checked(omni, random_prompts(3, seed=13))
        assert replicas(omni)[1].routed == routed  # all of it went to replica 0
        assert wait_until(lambda: not pid_alive(frozen.pid), 10.0)  # a hung replica is killed
    finally:
        if pid_alive(frozen.pid):
            os.kill(frozen.pid, signal.SIGKILL)
    assert wait_until(lambda: replicas(omni)[1].state.value == "up", RECOVERY_S), replicas(omni)
    assert replicas(omni)[1].pid != frozen.pid
