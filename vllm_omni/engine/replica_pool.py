"""`StagePool`: the orchestrator's handle on one logical stage and its replicas (spec 001's StagePool).

A stage with `runtime.num_replicas: N` (or `--omni-dp-size-local N`) runs N replicas, each a
stage worker process of its own with a `StageClient`. The pool routes each request's first
message to an UP replica chosen by the load-balancing policy (load_balancer.py) and remembers
the choice, so the request's later messages (streamed input chunks, pause/resume, abort) reach
the replica that holds it. A replica's queue length is what the orchestrator routed to it and
it has not finished: known at once, without a round trip, and never stale.

A pool of one replica behaves exactly as a single stage client did: same names, same
errors, same health.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import vllm_omni.envs as envs
from vllm_omni.config.stage_config import StageConfig
from vllm_omni.engine.load_balancer import LoadBalancer, ReplicaLoad
from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.stage_client import ReplicaHealth, StageClient, StageDownError, StageHealth, StageState
from vllm_omni.engine.stage_init.devices import get_stage_devices_per_replica, split_devices_for_replicas
from vllm_omni.stage_io import StageInfo


# Which per-replica state a stage shows when none of its replicas is UP: the most hopeful.
_NOT_UP_ORDER = (StageState.RESTARTING, StageState.STARTING, StageState.DOWN, StageState.STOPPED)


@dataclass(frozen=True)
class ReplicaRef:
    """One replica of one stage, e.g. the supervisor's key; prints as its name."""

    stage_id: int
    replica: int
    name: str = field(compare=False)

    def __str__(self) -> str:
        return self.name


class StagePool:
    def __init__(self, stage_id: int, model_stage: str | None, num_replicas: int, policy: LoadBalancer) -> None:
        self.stage_id = stage_id
        self.model_stage = model_stage
        self.name = f"stage {stage_id}" + (f" ({model_stage})" if model_stage else "")  # for messages
        self.policy = policy
        self.replicas: list[StageClient | None] = [None] * num_replicas  # by replica id; None until launched
        self._routed: dict[str, int] = {}  # request key -> the replica that holds it
        self._queues: Counter[int] = Counter()
        self.routed: Counter[int] = Counter()  # requests each replica was given, ever (restarts included)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def ref(self, replica: int) -> ReplicaRef:
        name = self.name if self.num_replicas == 1 else f"{self.name} replica {replica}"
        return ReplicaRef(self.stage_id, replica, name)

    def clients(self) -> list[StageClient]:
        return [c for c in self.replicas if c is not None]

    @property
    def info(self) -> StageInfo | None:
        """What the stage reported when it came up (every replica runs the same config)."""
        return next((c.info for c in self.clients() if c.info is not None), None)

    @property
    def is_up(self) -> bool:
        return any(c.state == StageState.UP for c in self.clients())

    # --- routing --------------------------------------------------------------
    def route(self, key: str) -> StageClient:
        """Give request `key` to an UP replica (the policy picks) and remember it."""
        up = [r for r, c in enumerate(self.replicas) if c is not None and c.state == StageState.UP]
        if not up:
            raise StageDownError(self.stage_id, self.down_message())
        replica = up[0] if len(up) == 1 else self.policy.choose([ReplicaLoad(r, self._queues[r]) for r in up])
        self.release(key)
        self._routed[key] = replica
        self._queues[replica] += 1
        self.routed[replica] += 1
        client = self.replicas[replica]
        assert client is not None
        return client

    def client_of(self, key: str) -> StageClient | None:
        """The replica that holds request `key` (None: not routed here, or finished)."""
        replica = self._routed.get(key)
        return None if replica is None else self.replicas[replica]

    def replica_of(self, key: str) -> int | None:
        return self._routed.get(key)

    def release(self, key: str) -> None:
        """Request `key` finished here (or failed, or was aborted)."""
        replica = self._routed.pop(key, None)
        if replica is not None:
            self._queues[replica] -= 1

    def keys_on(self, replica: int) -> list[str]:
        return [k for k, r in self._routed.items() if r == replica]

    def queue(self, replica: int) -> int:
        return self._queues[replica]

    def down_message(self) -> str:
        if not self.clients():  # a stage that headless processes run (engine/stage_master.py)
            return f"{self.name} has no replica: none has registered yet"
        return "; ".join(f"{c.name} is {c.state.value}: {c.reason or 'not ready'}" for c in self.clients())

    # --- health and stats -----------------------------------------------------
    def health(self, replica_health: list[StageHealth]) -> StageHealth:
        """The stage's health from its replicas' (one per replica, in replica order): UP while
        any replica is UP; otherwise the most hopeful state (a replica restarting)."""
        if not replica_health:
            return StageHealth(self.stage_id, self.model_stage, StageState.STARTING, self.down_message(), None, None)
        replicas = tuple(ReplicaHealth(r, h.pid, h.state, self._queues[r], self.routed[r], h.reason, h.retry_after_s)
                         for r, h in enumerate(replica_health))
        up = [h for h in replica_health if h.state == StageState.UP]
        if up:
            base = up[0]
        else:
            base = min(replica_health, key=lambda h: (_NOT_UP_ORDER.index(h.state),
                                                       h.retry_after_s if h.retry_after_s is not None else 0.0))
        return dataclasses.replace(base, replicas=replicas)

    async def stats(self, timeout_s: float) -> StageStats:
        """The stage's stats: its replica's, or the sum over the UP replicas."""
        if self.num_replicas == 1:
            return await self.replicas[0].stats(timeout_s)  # type: ignore[union-attr]
        up = [c for c in self.clients() if c.state == StageState.UP]
        if not up:
            raise StageDownError(self.stage_id, self.down_message())
        results = await asyncio.gather(*(c.stats(timeout_s) for c in up), return_exceptions=True)
        answered = [r for r in results if isinstance(r, StageStats)]
        if not answered:
            raise next(r for r in results if isinstance(r, BaseException))
        return _sum_stats(self.stage_id, answered)


def _sum_stats(stage_id: int, stats: list[StageStats]) -> StageStats:
    def total(name: str) -> int | None:
        values = [getattr(s, name) for s in stats]
        return None if any(v is None for v in values) else sum(values)

    drops: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for s in stats:
        drops.update(s.transport_drops)
        counts.update(s.counts)
    return StageStats(nonce=stats[0].nonce, stage_id=stage_id, num_unfinished=sum(s.num_unfinished for s in stats),
                      kv_free_blocks=total("kv_free_blocks"), kv_total_blocks=total("kv_total_blocks"),
                      num_waiting=total("num_waiting"), num_running=total("num_running"),
                      diffusion_steps=total("diffusion_steps"), transport_drops=dict(drops), counts=dict(counts))


def replica_configs(stage: StageConfig) -> list[StageConfig]:
    """Each replica's stage config: its share of the stage's devices (spec 002 pool or template
    mode) and its replica id set (`envs.REPLICA_ID`: a hook or a log may tell replicas apart)."""
    runtime = stage.runtime
    per_replica = get_stage_devices_per_replica(stage)
    try:
        devices = split_devices_for_replicas(runtime.devices, runtime.num_replicas, per_replica, stage.stage_id)
    except ValueError as e:
        example = ",".join(str(d) for d in range(runtime.num_replicas * per_replica))
        raise ValueError(f"{e}. With num_replicas={runtime.num_replicas}, list every replica's devices (pool mode, "
                         f"e.g. devices: \"{example}\") or one replica's within [0, {per_replica}) (template mode; "
                         "spec 002)") from None
    return [dataclasses.replace(stage, runtime=dataclasses.replace(
        runtime, devices=replica_devices, env=(*runtime.env, (envs.REPLICA_ID.name, str(replica)))))
        for replica, replica_devices in enumerate(devices)]
