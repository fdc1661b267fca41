"""The Ray launcher: a StageLauncher whose stage runs in a Ray actor (`--worker-backend ray`).

RayCluster (ray_cluster.py) makes one per stage launch. The actor runs `run_stage_worker` with
the same sockets as a spawned process would; its death, or its worker returning, is reported
like a process exit. Importing this module does not import ray.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from typing import Any

from vllm_omni.engine.stage_init_utils import stage_runtime_env
from vllm_omni.engine.stage_launcher import OnExit
from vllm_omni.engine.stage_worker import WorkerSpec, run_stage_worker

logger = logging.getLogger(__name__)


class RayLauncher:
    """A StageLauncher (engine/stage_launcher.py) whose stage is a Ray actor."""

    def __init__(self, ray: Any, actor_cls: Any, spec: WorkerSpec, name: str, options: dict[str, float]) -> None:
        self.spec = spec
        self.name = name
        self.options = options
        self.pid: int | None = None  # known once the stage reports StageReady (from its own process)
        self._ray = ray
        self._actor_cls = actor_cls
        self._actor: Any = None
        self._ref: Any = None
        self._exited = asyncio.Event()

    def start(self, on_exit: OnExit) -> None:
        loop = asyncio.get_running_loop()
        # Not restarted by Ray: our supervisor decides (backoff, bounded attempts, /health).
        self._actor = self._actor_cls.options(name=self.name, max_restarts=0, max_task_retries=0,
                                              **self.options).remote()
        self._ref = self._actor.run.remote(self.spec)

        def done(fut: concurrent.futures.Future) -> None:  # on a Ray thread
            try:
                loop.call_soon_threadsafe(self._finished, fut, on_exit)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                logger.debug("stage %d actor ended after the event loop closed", self.spec.stage_id)

        self._ref.future().add_done_callback(done)

    def _finished(self, fut: concurrent.futures.Future, on_exit: OnExit) -> None:
        try:
            how = f"exited with code {fut.result()}"
        except self._ray.exceptions.RayError as e:
            how = f"died: {e}"
        self.kill()  # an actor whose worker returned still holds its process and resources
        self._exited.set()
        on_exit(f"Ray actor {self.name} {how}")

    async def stop(self, timeout_s: float, graceful: bool) -> None:
        if self._actor is None:
            return
        if graceful and await self._wait(timeout_s):
            return  # the worker returned after Shutdown; the actor was killed on the way
        if graceful:
            logger.warning("stage %d (Ray actor %s) did not exit within %ss; killing it",
                           self.spec.stage_id, self.name, timeout_s)
        self.kill()
        if not await self._wait(timeout_s):
            logger.error("Ray did not report stage %d's actor %s dead within %ss",
                         self.spec.stage_id, self.name, timeout_s)

    async def _wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def kill(self) -> None:
        if self._actor is not None and self._ray.is_initialized():
            self._ray.kill(self._actor, no_restart=True)

    def stop_blocking(self, timeout_s: float) -> None:
        if self._actor is None or self._exited.is_set() or not self._ray.is_initialized():
            return
        self.kill()
        self._ray.wait([self._ref], timeout=timeout_s)


class StageActor:
    """The actor's class (ray.remote wraps it when a cluster is connected)."""

    def run(self, spec: WorkerSpec) -> int:
        return _actor_main(spec)


def _actor_main(spec: WorkerSpec) -> int:
    """A stage worker inside a Ray worker process. Ray started the process and ends it (ray.kill,
    or when its owner, the orchestrator's process, dies): no process group or death signal here."""
    # The worker exits when its parent is gone: here that parent is the raylet, not the orchestrator.
    spec = dataclasses.replace(spec, parent_pid=os.getppid())
    logging.basicConfig(level=spec.log_level, format=f"[stage {spec.stage_id}] %(levelname)s %(name)s: %(message)s")
    # runtime.devices is not applied: Ray set CUDA_VISIBLE_DEVICES to the GPUs it gave the actor.
    with stage_runtime_env(spec.stage_id, spec.stage.runtime):
        if spec.torch_threads is not None:
            import torch

            torch.set_num_threads(spec.torch_threads)
        return run_stage_worker(spec, device="auto")
