"""How a stage worker is started and stopped: a spawned process or a thread.

Both run `stage_worker.run_stage_worker` with the same sockets; the orchestrator sees
the same StageClient either way. Exits are reported to the event loop as they happen
(the process sentinel is watched by the loop; the thread posts its own exit), and all
reaping happens on the loop thread, so no two threads ever wait on one child.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from typing import Protocol

from vllm_omni.config.stage_config import PipelineConfig, StageConfig, WorkerType
from vllm_omni.engine.stage_init_utils import terminate_alive_proc
from vllm_omni.engine.stage_worker import WorkerSpec, run_stage_worker, stage_process_main

logger = logging.getLogger(__name__)

OnExit = Callable[[str], None]


class StageLauncher(Protocol):
    pid: int | None

    def start(self, on_exit: OnExit) -> None: ...  # call from the event loop thread
    async def stop(self, timeout_s: float, graceful: bool) -> None: ...  # graceful: a Shutdown was sent
    def kill(self) -> None: ...  # immediate, does not wait
    def stop_blocking(self, timeout_s: float) -> None: ...  # when no event loop is left


class ProcessLauncher:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.proc: mp.process.BaseProcess | None = None
        self._exited = asyncio.Event()
        self._on_exit: OnExit | None = None

    def start(self, on_exit: OnExit) -> None:
        self._on_exit = on_exit
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.proc = ctx.Process(target=stage_process_main, args=(self.spec,), daemon=False,
                                name=f"vllm-omni-stage-{self.spec.stage_id}")
        self.proc.start()
        self.pid = self.proc.pid
        asyncio.get_running_loop().add_reader(self.proc.sentinel, self._sentinel_ready)

    def _sentinel_ready(self) -> None:
        assert self.proc is not None
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        # The sentinel fires when the child closes its end of the pipe, a moment before it is
        # a reapable zombie; this join returns within microseconds.
        self.proc.join(5.0)
        code = self.proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        self._exited.set()
        if self._on_exit is not None:
            self._on_exit(f"process {self.pid} {how}")

    async def stop(self, timeout_s: float, graceful: bool) -> None:
        if self.proc is None:
            return
        if not graceful or not await self._wait(timeout_s):
            if graceful:
                logger.warning("stage %d (pid %s) did not exit within %ss; terminating it",
                               self.spec.stage_id, self.pid, timeout_s)
            self._signal_group(signal.SIGTERM)
            if not await self._wait(timeout_s):
                self._signal_group(signal.SIGKILL)
                await self._wait(timeout_s)
        self._signal_group(signal.SIGKILL)  # whatever the stage started and left behind

    async def _wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        if self.pid is None:
            return
        try:
            # The child made itself a group leader; the group outlives it while any member lives.
            os.killpg(self.pid, sig)
            return
        except ProcessLookupError:
            pass  # no such group: all gone, or the child has not run setpgid yet
        if not self._exited.is_set():  # not reaped, so the pid is still this child's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return

    def stop_blocking(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        terminate_alive_proc(self.proc, timeout_s)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of its group; never a bare pid here
        except ProcessLookupError:
            return


class ThreadLauncher:
    """`runtime.process: false`: the worker runs in a thread of this process, on its own CUDA
    stream (debugging, and stages that share a GPU's context instead of taking turns on it)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = _in_process_device(spec)
        self.pid: int | None = os.getpid()
        self._exited = asyncio.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_exit: OnExit) -> None:
        loop = asyncio.get_running_loop()

        def run() -> None:
            code = 1
            try:
                with _own_cuda_stream(self.spec, self.device):
                    code = run_stage_worker(self.spec, self.device)
            finally:
                try:
                    loop.call_soon_threadsafe(self._finished, code, on_exit)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    logger.debug("stage %d thread ended after the event loop closed", self.spec.stage_id)

        self._thread = threading.Thread(target=run, name=f"vllm-omni-stage-{self.spec.stage_id}", daemon=True)
        self._thread.start()

    def _finished(self, code: int, on_exit: OnExit) -> None:
        self._exited.set()
        on_exit(f"in-process worker thread exited with code {code}")

    async def stop(self, timeout_s: float, graceful: bool) -> None:
        # A thread cannot be terminated: it stops at its next message (Shutdown) or not at all.
        try:
            await asyncio.wait_for(self._exited.wait(), timeout_s)
        except asyncio.TimeoutError:
            logger.error("in-process stage %d did not stop within %ss (threads cannot be killed)",
                         self.spec.stage_id, timeout_s)

    def kill(self) -> None:
        logger.warning("in-process stage %d cannot be killed; it stops at its next message", self.spec.stage_id)

    def stop_blocking(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


def _own_cuda_stream(spec: WorkerSpec, device: str) -> contextlib.AbstractContextManager:
    """The stage thread's own CUDA stream. Stages in one process share one CUDA context, so their
    kernels can run side by side (separate stage processes take turns on the GPU instead); on
    one stream they would queue behind each other. Stages that decode step by step (AR: thinker,
    talker) get the higher priority: their small kernels pace the pipeline, and a generation
    stage's large ones (code2wav, diffusion) fill the GPU around them."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    import torch

    priority = -1 if spec.stage.worker_type is WorkerType.AR else 0
    return torch.cuda.stream(torch.cuda.Stream(device, priority=priority))


def _in_process_device(spec: WorkerSpec) -> str:
    # Threads share one CUDA_VISIBLE_DEVICES, so an in-process stage picks its device by index.
    import torch

    if torch.cuda.is_available():
        return f"cuda:{spec.stage.runtime.device_ids[0]}"
    return "auto"


def torch_threads_for(stage: StageConfig, pipeline: PipelineConfig) -> int | None:
    """The stage's torch thread count; None when OMP_NUM_THREADS is set (torch follows it)."""
    # Stages on one host share its cores; without a limit each would use all of them.
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in stage.runtime.env_dict():
        return None
    # One core stays with the orchestrator's process (prompt and media processing, routing): a
    # stage whose OpenMP threads compete with it for every core spin-waits, measured 30-50x
    # slower per step on a 2-core machine (one stage with 2 threads vs 1).
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, _num_processes(pipeline)))


def limit_own_torch_threads(pipeline: PipelineConfig) -> int | None:
    """Keep the orchestrator (called from its thread) to the cores its stage processes leave
    it, and return the previous torch thread count to restore at shutdown (None: unchanged).

    Its torch ops (growing a stream's hidden states, bridge copies) would otherwise run on
    one OpenMP thread per core while the stages keep those cores busy (GPU stages spin-wait on
    CUDA): a parallel op then waits for threads the OS has descheduled. Measured on the H200
    with Qwen3-Omni: each hand-off between stages took ~50 ms; first audio 206 -> 98-108 ms
    with one thread. With OpenMP the count is the calling thread's; a stage in this process
    (`process: false`) leaves it alone, in case the build's pool is process-wide.
    """
    if "OMP_NUM_THREADS" in os.environ or not all(s.runtime.process for s in pipeline.stages):
        return None
    import torch

    cores, processes = os.cpu_count() or 1, _num_processes(pipeline)
    own = max(1, cores - processes * max(1, (cores - 1) // max(1, processes)))
    previous = torch.get_num_threads()
    if own < previous:
        torch.set_num_threads(own)
        logger.info("the orchestrator uses %d torch thread(s); its %d stage processes the other cores",
                    own, processes)
        return previous
    return None


def _num_processes(pipeline: PipelineConfig) -> int:
    return sum(s.runtime.num_replicas for s in pipeline.stages if s.runtime.process)
