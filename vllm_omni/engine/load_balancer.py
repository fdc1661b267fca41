"""Which replica of a stage takes a new request: `--omni-lb-policy` (spec 001).

    policy = make_policy("least-queue-length")
    replica = policy.choose([ReplicaLoad(0, queue=3), ReplicaLoad(2, queue=1)])   # -> 2

A policy sees only the replicas that are UP, each with its queue length (the requests the
orchestrator has routed to it that it has not finished, replica_pool.StagePool), and returns
one replica id. It routes only a request's *first* message to a stage; the request's later
chunks and its abort follow it to the same replica.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

LB_POLICIES = ("random", "round-robin", "least-queue-length")
DEFAULT_LB_POLICY = "random"  # spec 001


@dataclass(frozen=True)
class ReplicaLoad:
    replica: int
    queue: int  # requests routed to the replica and not finished there


class LoadBalancer(Protocol):
    name: str

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int: ...  # candidates: non-empty, UP only


class RandomPolicy:
    """Uniformly at random: no shared state, good when requests cost about the same."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        return self._rng.choice(candidates).replica


class RoundRobinPolicy:
    """Each replica in turn, by replica id. A replica that is down is skipped, and the turn
    goes on from the last one chosen, so a replica that comes back takes its turn at once."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last = -1

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        ids = sorted(c.replica for c in candidates)
        chosen = next((r for r in ids if r > self._last), ids[0])
        self._last = chosen
        return chosen


class LeastQueueLengthPolicy:
    """The replica with the fewest requests in flight; ties go round robin (an idle pool
    spreads sequential requests instead of sending them all to replica 0)."""

    name = "least-queue-length"

    def __init__(self) -> None:
        self._tie_break = RoundRobinPolicy()

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        shortest = min(c.queue for c in candidates)
        return self._tie_break.choose([c for c in candidates if c.queue == shortest])


def make_policy(name: str, seed: int | None = None) -> LoadBalancer:
    """A fresh policy (each stage pool has its own state)."""
    if name == "random":
        return RandomPolicy(seed)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-queue-length":
        return LeastQueueLengthPolicy()
    raise ValueError(f"unknown load-balancing policy {name!r}; choose one of {', '.join(LB_POLICIES)}")
