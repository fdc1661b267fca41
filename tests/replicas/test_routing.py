"""Routing across the replicas of a stage, at the unit level: each --omni-lb-policy, and the
pool that applies it (only UP replicas get new requests; a request's later messages follow it;
queue lengths count what was routed and not released)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from vllm_omni.engine.load_balancer import (
    LB_POLICIES, LeastQueueLengthPolicy, RandomPolicy, ReplicaLoad, RoundRobinPolicy, make_policy,
)
from vllm_omni.engine.replica_pool import StagePool
from vllm_omni.engine.stage_client import StageDownError, StageHealth, StageState
from vllm_omni.stage_io import StageInfo


def loads(*queues: int, ids: tuple[int, ...] | None = None) -> list[ReplicaLoad]:
    return [ReplicaLoad(r, q) for r, q in zip(ids or range(len(queues)), queues)]


def test_round_robin_cycles_by_replica_id_and_skips_a_missing_one():
    policy = RoundRobinPolicy()
    assert [policy.choose(loads(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    # Replica 1 is down: the turn passes it by, and it takes its turn again once back.
    assert [policy.choose(loads(0, 0, ids=(0, 2))) for _ in range(3)] == [0, 2, 0]
    assert [policy.choose(loads(0, 0, 0)) for _ in range(3)] == [1, 2, 0]


def test_least_queue_length_picks_the_shortest_and_spreads_ties():
    policy = LeastQueueLengthPolicy()
    assert policy.choose(loads(3, 1, 2)) == 1
    assert policy.choose(loads(5, 4, ids=(2, 0))) == 0
    assert [LeastQueueLengthPolicy().choose(loads(0, 0)) for _ in range(2)] == [0, 0]  # fresh: replica 0 first
    assert [policy.choose(loads(0, 0)) for _ in range(4)] == [1, 0, 1, 0]  # an idle pool alternates


def test_random_uses_every_candidate_and_only_candidates():
    policy = RandomPolicy(seed=7)
    picks = Counter(policy.choose(loads(9, 0, 0, ids=(1, 3, 4))) for _ in range(600))
    assert set(picks) == {1, 3, 4}  # load does not matter to it
    assert min(picks.values()) > 150  # about 200 each


def test_make_policy_knows_the_documented_names():
    assert [make_policy(name).name for name in LB_POLICIES] == ["random", "round-robin", "least-queue-length"]
    with pytest.raises(ValueError, match="unknown load-balancing policy 'fastest'"):
        make_policy("fastest")


# ------------------------------------------------------------------ the pool


@dataclass
class FakeReplica:
    """What the pool reads of a replica's StageClient."""

    name: str
    state: StageState = StageState.UP
    reason: str | None = None
    info: StageInfo | None = None


def pool_of(n: int, policy: str) -> StagePool:
    pool = StagePool(1, "talker", n, make_policy(policy))
    for r in range(n):
        info = StageInfo(engine="ar", device="cpu", vocab_size=10)
        pool.replicas[r] = FakeReplica(pool.ref(r).name, info=info)  # type: ignore[assignment]
    return pool


def test_pool_routes_new_requests_to_up_replicas_and_later_messages_follow():
    pool = pool_of(3, "least-queue-length")
    first = [pool.route(f"a{i}").name for i in range(3)]
    assert first == ["stage 1 (talker) replica 0", "stage 1 (talker) replica 1", "stage 1 (talker) replica 2"]
    assert [pool.queue(r) for r in range(3)] == [1, 1, 1]
    pool.release("a1")
    assert pool.route("b").name.endswith("replica 1")  # the shortest queue
    assert pool.client_of("a2").name.endswith("replica 2") and pool.client_of("a1") is None
    pool.replicas[0].state = StageState.DOWN  # type: ignore[union-attr]
    assert {pool.route(f"c{i}").name[-1] for i in range(4)} == {"1", "2"}  # never the down one
    assert sorted(pool.keys_on(0)) == ["a0"]  # what the down replica held
    assert pool.routed == Counter({0: 1, 1: 4, 2: 3})


def test_pool_with_no_replica_up_refuses_and_one_replica_keeps_its_plain_name():
    pool = pool_of(2, "round-robin")
    for c in pool.replicas:
        c.state, c.reason = StageState.DOWN, "killed"  # type: ignore[union-attr]
    with pytest.raises(StageDownError, match="replica 0 is down: killed; stage 1 .talker. replica 1 is down"):
        pool.route("x")
    single = pool_of(1, "random")
    assert single.route("x").name == "stage 1 (talker)" and single.ref(0).name == "stage 1 (talker)"


def test_pool_health_is_up_while_any_replica_is_and_lists_each():
    pool = pool_of(2, "round-robin")
    pool.route("a")

    def health(state: StageState, pid: int, retry: float | None = None) -> StageHealth:
        return StageHealth(1, "talker", state, None if state == StageState.UP else "killed", pid, 0.1,
                           retry_after_s=retry)

    h = pool.health([health(StageState.RESTARTING, 11, 3.0), health(StageState.UP, 12)])
    assert (h.state, h.pid) == (StageState.UP, 12)
    assert [(r.replica, r.pid, r.state, r.queue, r.routed) for r in h.replicas] == [
        (0, 11, StageState.RESTARTING, 1, 1), (1, 12, StageState.UP, 0, 0)]
    h = pool.health([health(StageState.DOWN, 11), health(StageState.RESTARTING, 12, 5.0)])
    assert (h.state, h.retry_after_s) == (StageState.RESTARTING, 5.0)  # the most hopeful
