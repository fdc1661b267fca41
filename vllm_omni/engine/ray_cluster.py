"""Stages as Ray actors (`--worker-backend ray`): the cluster the launchers (ray_launcher.py) use.

    cluster = RayCluster.connect(address, pipeline)   # Orchestrator.start, on the loop thread
    launcher = cluster.launcher(spec)                 # a StageLauncher, one per stage launch
    cluster.close()                                   # after every stage has stopped

Each stage runs in an actor that asks Ray for its resources (one CPU, the stage's GPUs);
requests and outputs keep travelling over our own transport (ZMQ ipc and shared memory), so
actors must share this host (docs/deployment.md, "Ray"). Ray only places, starts and kills
the processes.

Ownership: if we started Ray (or connected this process to a cluster), the last pipeline of
this process to close shuts our connection down, which for a local instance we started stops
it entirely; if the caller had already initialized Ray, only our actors are killed. Importing
this module does not import ray.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from typing import Any

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.engine.ray_launcher import RayLauncher, StageActor
from vllm_omni.engine.stage_worker import WorkerSpec

logger = logging.getLogger(__name__)

WORKER_BACKENDS = ("multi_process", "ray")
RAY_EXTRA = 'pip install "vllm-omni[ray]"'
_CONNECT_CHECK_S = 10.0  # how long a cluster's address may take to accept a connection
_INIT_TIMEOUT_S = 120.0  # ray.init / ray.shutdown (a local start takes seconds)
_RESOURCES_SETTLE_S = 5.0  # how long freed resources may take to show as available


def worker_backend_problem(backend: str, ray_address: str | None) -> str | None:
    """Why this backend choice cannot work (None: it can); checked before anything starts."""
    if backend not in WORKER_BACKENDS:
        return f"the worker backend (--worker-backend) must be one of {', '.join(WORKER_BACKENDS)}, got {backend!r}"
    if backend != "ray":
        return None if ray_address is None else "a Ray address (--ray-address) needs --worker-backend ray"
    try:
        import ray  # noqa: F401 - only whether it imports
    except ImportError as e:
        return f"--worker-backend ray needs Ray, an optional extra: {RAY_EXTRA} ({e})"
    return None


def actor_resources(stage: StageConfig, pipeline: PipelineConfig, gpus: bool) -> dict[str, float]:
    """What a stage's actor asks Ray for: one CPU, and its share of the GPUs it runs on.

    A stage on several devices (tensor parallel) takes them whole; stages that share one
    device (the bundled Omni configs put talker and code2wav together) split it evenly, so
    Ray can place them on one GPU as the config intends. Ray picks which GPUs; `devices`
    only counts them here."""
    if not gpus:
        return {"num_cpus": 1, "num_gpus": 0}
    devices = stage.runtime.device_ids
    count = max(len(devices), stage.engine_args.tensor_parallel_size)
    if count > 1:
        return {"num_cpus": 1, "num_gpus": float(count)}
    sharing = sum(1 for s in pipeline.stages if s.runtime.process and devices[0] in s.runtime.device_ids)
    return {"num_cpus": 1, "num_gpus": math.floor(10_000 / sharing) / 10_000}  # Ray's resource precision


class RayCluster:
    """This process's use of a Ray cluster for one pipeline."""

    def __init__(self, ray: Any, owned: bool, pipeline: PipelineConfig, gpus: bool) -> None:
        self._ray = ray
        self.owned = owned  # a user of the _RaySession (our ray.init), not of the caller's Ray
        self._pipeline = pipeline
        self._gpus = gpus
        self._actor_cls = ray.remote(StageActor)
        # Actor names (`ray list actors`, ray.get_actor) say whose they are: one tag per pipeline.
        self.actor_prefix = f"vllm-omni-{os.getpid()}-{uuid.uuid4().hex[:6]}-"
        self._launches: Counter[int] = Counter()

    @classmethod
    def connect(cls, address: str | None, pipeline: PipelineConfig) -> RayCluster:
        """Use the Ray this process already initialized, else connect to `address`, else
        (no address and no RAY_ADDRESS) start a local instance sized for the pipeline."""
        import ray
        import torch

        global _session
        with _session_lock:
            owned = _session is not None or not ray.is_initialized()
            if _session is None and owned:
                kwargs = _init_kwargs(address, sum(1 for s in pipeline.stages if s.runtime.process))
                _check_reachable(kwargs.get("address", os.environ.get("RAY_ADDRESS")))
                _session = _RaySession(kwargs)
            elif _session is not None and address != _session.address:
                logger.warning("ray_address %r ignored: this process already uses the Ray it joined for another "
                               "pipeline (%r)", address, _session.address)
            if owned:
                _session.users += 1
            local = owned and _session.local
        cluster = cls(ray, owned, pipeline, gpus=torch.cuda.is_available())
        try:
            cluster._check_resources(local)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _check_resources(self, local: bool) -> None:
        """Say when the stages cannot all be placed. A local instance we started cannot grow:
        fail now rather than at stage_init_timeout. A cluster may (an autoscaler): warn."""
        need: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
        for stage in self._pipeline.stages:
            if stage.runtime.process:
                res = actor_resources(stage, self._pipeline, self._gpus)
                need["CPU"] += res["num_cpus"]
                need["GPU"] += res["num_gpus"]

        def short() -> dict[str, float]:
            have = self._ray.available_resources() if local else self._ray.cluster_resources()
            return {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-6}

        if not short():
            return
        if not local:
            logger.warning("the Ray cluster has fewer resources than the stage actors need (%s): some will wait "
                           "for them", short())
            return
        deadline = time.monotonic() + _RESOURCES_SETTLE_S  # actors killed a moment ago free theirs soon
        while short() and time.monotonic() < deadline:
            time.sleep(0.2)
        if short():
            raise RuntimeError(
                f"the local Ray instance this process started has too few free resources for the stage actors "
                f"(they need {need}, free: {self._ray.available_resources()}), e.g. because another pipeline of "
                "this process holds them; start Ray yourself with enough (`ray start --head --num-cpus N`) and "
                "pass --ray-address auto")

    def launcher(self, spec: WorkerSpec) -> RayLauncher:
        self._launches[spec.stage_id] += 1
        name = f"{self.actor_prefix}stage{spec.stage_id}-{self._launches[spec.stage_id]}"
        options = actor_resources(spec.stage, self._pipeline, self._gpus)
        return RayLauncher(self._ray, self._actor_cls, spec, name, options)

    def close(self) -> None:
        global _session
        with _session_lock:
            if not self.owned or _session is None:
                return
            _session.users -= 1
            if _session.users == 0:  # the last pipeline of this process using it
                _session.shut_down()
                _session = None


class _RaySession:
    """The Ray this process called ray.init for, shared by its pipelines until the last closes.

    ray.init runs on a thread of its own that lives until ray.shutdown: Ray ties the processes
    it starts (a local instance) to the life of the thread that started them, and an
    orchestrator's thread ends with its pipeline, while another pipeline may still use Ray."""

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        self.address = init_kwargs.get("address")
        self.local = self.address == "local"  # an instance of our own, not a cluster we joined
        self.users = 0
        self._stop = threading.Event()
        self._result: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(init_kwargs,), name="vllm-omni-ray", daemon=True)
        self._thread.start()
        try:
            self._result.result(_INIT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"Ray did not start (or connect) within {_INIT_TIMEOUT_S}s") from None

    def _run(self, init_kwargs: dict[str, Any]) -> None:
        import ray

        try:
            ray.init(**init_kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self._result.set_exception(e)
            return
        self._result.set_result(None)
        self._stop.wait()
        ray.shutdown()

    def shut_down(self) -> None:
        self._stop.set()
        self._thread.join(_INIT_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("ray.shutdown did not return within %ss", _INIT_TIMEOUT_S)


_session: _RaySession | None = None
_session_lock = threading.Lock()


def _init_kwargs(address: str | None, num_actors: int) -> dict[str, Any]:
    if address is None and os.environ.get("RAY_ADDRESS"):
        return {}  # Ray's convention: the cluster RAY_ADDRESS names (e.g. inside a Ray job)
    if address is None or address == "local":
        # Our own instance on this host. Logical CPUs are what actors are scheduled by; stages
        # on one host share its cores already (torch threads are divided between them), so a
        # pipeline of more stages than cores must still fit. No dashboard: it takes seconds.
        return {"address": "local", "num_cpus": max(os.cpu_count() or 1, num_actors), "include_dashboard": False}
    return {"address": address}


def _check_reachable(address: str | None) -> None:
    """Fail fast when a cluster's HOST:PORT does not answer: ray.init retries it for minutes.
    ("auto" finds the clusters running on this host, "local" starts one: nothing to check.)"""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_CHECK_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None
