"""The one stage worker main: read messages, step the engine, send outputs, heartbeat.

The same `run_stage_worker` runs in a spawned child (`runtime.process: true`, through
`stage_process_main`) and in a thread of the caller's process (`process: false`); only
the launcher differs. Startup: build the engine, then send StageReady (or
StageInitFailed with the traceback). A heartbeat thread with its own socket reports
every `heartbeat_interval_s`, so a long forward pass does not look like a dead stage.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from vllm_omni.config.stage_config import StageConfig, WorkerType
from vllm_omni.engine import stage_init_utils as siu
from vllm_omni.engine.serving_stalls import StepWatch, freeze_startup_heap, log_kernel_compiles, log_long_pauses
from vllm_omni.engine.step_profiler import StepProfiler
from vllm_omni.engine.messages import (
    AbortRequests, Heartbeat, PauseRequests, Shutdown, SleepRequest, SleepStatus, StageFatal, StageInitFailed,
    StageOutputBatch, StageReady, StageStats, StatsRequest,
)
from vllm_omni.engine.registration import MasterLink, RegistrationRefused, RemoteAttach
from vllm_omni.engine.transport import LinkGuard, MessageCodec, WorkerChannel
from vllm_omni.engine.transport_guard import DEFAULT_MAX_MESSAGE_BYTES, ZapGuard, secure_client
from vllm_omni.stage_io import StageEngine, StageInputChunk, StageOutput, StageRequest, error_output

logger = logging.getLogger(__name__)

# How long an idle worker waits for a message before re-checking that its parent lives.
# A message wakes it at once; this is not a polling interval for work.
_IDLE_WAIT_MS = 1000


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a stage worker needs; picklable, since spawned children receive it."""

    stage: StageConfig
    model: str  # the served model; a stage's engine_args.model overrides it
    in_addr: str
    out_addr: str
    shm_threshold_bytes: int
    shm_prefix: str  # names the shared memory segments this worker sends
    heartbeat_interval_s: float
    stage_init_timeout_s: float
    parent_pid: int
    in_process: bool
    torch_threads: int | None = None  # set in the child; None leaves torch's default
    log_level: int = logging.WARNING  # the parent's level; spawned children start unconfigured
    # A headless replica (stage-based CLI): it binds its inbox on a free tcp port, registers with
    # the head there, and learns out_addr and its heartbeat interval from the answer.
    remote: RemoteAttach | None = None
    # The only segments it opens: named with this prefix, which its orchestrator was given for it
    # (None: none at all, everything comes inline, as over tcp).
    peer_shm_prefix: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # of any message it sends or receives

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id


def stage_process_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned stage process."""
    siu.set_death_signal(signal.SIGKILL)
    if os.getppid() != spec.parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    os.setpgid(0, 0)  # own process group: shutdown kills the stage and anything it started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which shuts us down
    if spec.remote is not None:  # the headless parent stops us with SIGTERM: say goodbye to the head first
        signal.signal(signal.SIGTERM, _raise_terminated)
    logging.basicConfig(level=spec.log_level, format=f"[stage {spec.stage_id}] %(levelname)s %(name)s: %(message)s")
    _thread_lock_for_progress_bars()
    # Visible devices are set before anything initializes CUDA (torch does so lazily).
    with siu.stage_runtime_setup(spec.stage_id, spec.stage.runtime):
        if spec.torch_threads is not None:
            import torch

            torch.set_num_threads(spec.torch_threads)
        try:
            code = run_stage_worker(spec, device="auto")
        except _Terminated:
            code = 0
    # The worker has closed its sockets; skipping interpreter teardown (torch's takes ~1 s)
    # makes shutdown fast. Nothing is left to flush but the log streams.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _thread_lock_for_progress_bars() -> None:
    # tqdm's default lock holds a multiprocessing RLock, a named semaphore that the os._exit
    # ending this process never releases: the resource tracker then warns of "leaked semaphore
    # objects" at shutdown. The loaders' progress bars here are this process's own: a thread
    # lock serves them, and no semaphore is made.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def run_stage_worker(spec: WorkerSpec, device: str) -> int:
    """Serve one stage until Shutdown (0) or a fatal error (1)."""
    ctx = zmq.Context()
    keys = spec.remote.keys if spec.remote is not None else None
    zap = ZapGuard(ctx, keys) if keys is not None else None  # before the inbox binds
    guard = LinkGuard(accept_shm_prefix=spec.peer_shm_prefix, keys=keys, max_message_bytes=spec.max_message_bytes,
                      stage=str(spec.stage_id))
    chan = WorkerChannel(ctx, spec.in_addr, None if spec.remote is not None else spec.out_addr,
                         spec.shm_threshold_bytes, spec.shm_prefix, guard)
    link: MasterLink | None = None
    stop = threading.Event()
    beat: threading.Thread | None = None
    leave = "stopped"
    try:
        if spec.remote is not None:
            try:
                spec, link = _join_head(ctx, chan, spec, spec.remote)
            except (RegistrationRefused, TimeoutError) as e:
                logger.error("%s", e)
                return 1
        beat = threading.Thread(target=_heartbeat_loop, args=(ctx, spec, stop), name=f"stage{spec.stage_id}-heartbeat",
                                daemon=True)
        beat.start()
        try:
            engine = _build_engine(spec, device)
            if spec.stage.engine_args.enable_sleep_mode:
                from vllm_omni.worker.sleep_mode import SleepableEngine, placeholder_weights

                engine = SleepableEngine(spec.stage_id, engine, lambda placeholder: _build_engine(dataclasses.replace(
                    spec, stage=placeholder_weights(spec.stage)) if placeholder else spec, device))
        except Exception:  # noqa: BLE001 - reported to the orchestrator, which names the stage
            leave = "initialization failed"
            chan.send(StageInitFailed(spec.stage_id, os.getpid(), traceback.format_exc()))
            return 1
        if not spec.in_process:  # a process of its own: nothing of the caller's heap to freeze
            freeze_startup_heap()
            log_long_pauses(f"stage {spec.stage_id}")
            log_kernel_compiles(f"stage {spec.stage_id}")
        chan.send(StageReady(spec.stage_id, os.getpid(), engine.describe()))
        try:
            return _serve(engine, chan, spec, link)
        except Exception:  # noqa: BLE001 - the loop itself broke: tell the orchestrator, then exit
            leave = "the worker loop failed"
            logger.exception("stage %d worker loop failed", spec.stage_id)
            chan.send(StageFatal(spec.stage_id, traceback.format_exc()))
            return 1
    finally:
        stop.set()
        if beat is not None:
            beat.join(timeout=5.0)
        if link is not None:
            link.close(leave)
        chan.close()
        if zap is not None:
            zap.stop()
        ctx.term()


def _join_head(ctx: zmq.Context, chan: WorkerChannel, spec: WorkerSpec,
               remote: RemoteAttach) -> tuple[WorkerSpec, MasterLink]:
    """A headless replica registers (retrying until stage_init_timeout), then sends where the
    head said, at the heartbeat interval it said."""
    link = MasterLink.register(ctx, remote, spec.stage_id, chan.inbox_endpoint, spec.stage_init_timeout_s)
    try:
        spec = dataclasses.replace(spec, out_addr=link.out_addr,
                                   heartbeat_interval_s=link.accepted.heartbeat_interval_s)
        logger.info("stage %d: registered with the head at %s as replica %d", spec.stage_id, remote.master,
                    link.accepted.replica)
        chan.connect_outbox(spec.out_addr)
        link.start()
    except BaseException:
        link.close("failed to connect")  # its socket must be closed before the context ends
        raise
    return spec, link


def _build_engine(spec: WorkerSpec, device: str) -> StageEngine:
    import torch

    worker_cls = _worker_class(spec.stage)
    # Serialize initialization per GPU so co-located stages do not size their KV caches while
    # another stage is still allocating. Threads of one process cannot use file locks that way:
    # they take a lock of the process, which also keeps a neighbour's CUDA graph captures away
    # from this stage's memory profiling (a device-wide wait during a capture is an error).
    if spec.in_process:
        with IN_PROCESS_INIT:
            return worker_cls(spec.stage, spec.model, device=device).build_engine()
    locks: list[int] = []
    if torch.cuda.is_available():
        # Every device of the replica: its tensor-parallel ranks, or a diffusion stage's world.
        devices = {"parallel_config": {"world_size": siu.get_stage_devices_per_replica(spec.stage)}}
        locks = siu.acquire_device_locks(spec.stage_id, devices, spec.stage_init_timeout_s)
    try:
        return worker_cls(spec.stage, spec.model, device=device).build_engine()
    finally:
        siu.release_device_locks(locks)


# Held while a stage that is a thread of this process builds its engine, and by the caller's
# own startup beside it (runtime.py): first imports of transformers' lazy modules in two threads
# at once can fail ("cannot import name 'AutoTokenizer' from 'transformers'").
IN_PROCESS_INIT = threading.Lock()


def _worker_class(stage: StageConfig) -> type:
    if stage.engine_args.worker_cls:
        return siu.import_dotted(stage.engine_args.worker_cls)
    if stage.worker_type == WorkerType.AR:
        from vllm_omni.worker.gpu_ar_worker import GPUARWorker

        return GPUARWorker
    if stage.worker_type == WorkerType.GENERATION:
        from vllm_omni.worker.gpu_generation_worker import GPUGenerationWorker

        return GPUGenerationWorker
    if stage.worker_type == WorkerType.DIFFUSION:
        from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

        return GPUDiffusionWorker
    raise ValueError(f"stage {stage.stage_id}: worker_type={stage.worker_type.value!r} has no engine yet")


def _serve(engine: StageEngine, chan: WorkerChannel, spec: WorkerSpec, link: MasterLink | None) -> int:
    profiler = StepProfiler(spec.stage_id)  # benchmarks only: off unless its variables are set
    watch = StepWatch(f"stage {spec.stage_id}")
    try:
        return _loop(engine, chan, spec, link, profiler, watch)
    finally:
        watch.close()
        profiler.close()


def _loop(engine: StageEngine, chan: WorkerChannel, spec: WorkerSpec, link: MasterLink | None,
          profiler: StepProfiler, watch: StepWatch) -> int:
    while True:
        # Requests waiting for streamed input or paused are no work: block on the socket (for a
        # short while only when the engine has work on the device to collect).
        busy = engine.has_work()
        msg = chan.recv(0 if busy else engine.poll_ms() or _IDLE_WAIT_MS)
        while msg is not None:  # drain everything queued before the next step
            if isinstance(msg, Shutdown):
                return 0
            _handle(msg, engine, chan, spec.stage_id)
            msg = chan.recv(0)
        if not engine.has_work():
            if not spec.in_process and os.getppid() != spec.parent_pid:
                logger.error("stage %d: parent process is gone; exiting", spec.stage_id)
                return 1
            if link is not None and link.lost is not None:
                return 1  # the link logged why
            continue
        with profiler.step():
            watch.started = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving new ones
                logger.exception("stage %d: engine step failed", spec.stage_id)
                outputs = engine.fail_all(f"stage {spec.stage_id}: engine step failed: {type(e).__name__}: {e}")
            watch.started = None
            if outputs:
                _send_outputs(chan, spec.stage_id, outputs)
                profiler.record_outputs(len(outputs))


def _handle(msg: object, engine: StageEngine, chan: WorkerChannel, stage_id: int) -> None:
    if isinstance(msg, StageRequest):
        try:
            engine.add_request(msg)
        except Exception as e:  # noqa: BLE001 - engines report bad requests as outputs; a bug here fails one
            logger.exception("stage %d: adding request %s failed", stage_id, msg.request_id)
            _send_outputs(chan, stage_id, [error_output(msg.request_id, f"stage {stage_id}: cannot add the request: "
                                                                        f"{type(e).__name__}: {e}")])
    elif isinstance(msg, StageInputChunk):
        engine.add_input(msg)
    elif isinstance(msg, AbortRequests):
        engine.abort(msg.request_ids)
    elif isinstance(msg, PauseRequests):
        engine.pause(msg.request_ids, msg.paused)
    elif isinstance(msg, StatsRequest):
        drops = {key.reason: n for key, n in chan.guard.counter.snapshot().items()}
        chan.send(StageStats(nonce=msg.nonce, stage_id=stage_id, **engine.stats(), transport_drops=drops))
    elif isinstance(msg, SleepRequest):
        chan.send(_sleep_or_wake(msg, engine, stage_id))
    else:
        raise TypeError(f"stage {stage_id}: unexpected message {type(msg).__name__}")


def _send_outputs(chan: WorkerChannel, stage_id: int, outputs: list[StageOutput]) -> None:
    try:
        chan.send(StageOutputBatch(stage_id, outputs))
        return
    except (TypeError, ValueError) as e:  # an output that cannot be encoded fails alone
        logger.warning("stage %d: an output batch could not be encoded (%s); sending one by one", stage_id, e)
    for out in outputs:
        try:
            chan.send(StageOutputBatch(stage_id, [out]))
        except (TypeError, ValueError) as e:
            chan.send(StageOutputBatch(stage_id, [error_output(out.request_id, f"stage {stage_id}: output "
                                                                               f"cannot be sent: {e}")]))


def _sleep_or_wake(msg: SleepRequest, engine: StageEngine, stage_id: int) -> SleepStatus:
    from vllm_omni.worker.sleep_mode import SleepableEngine, SleepRefused  # torch: only in a stage's process

    if not isinstance(engine, SleepableEngine):
        return SleepStatus(nonce=msg.nonce, stage_id=stage_id, sleeping=False,
                           error=f"stage {stage_id} does not run in sleep mode (enable_sleep_mode)")
    try:
        if msg.sleep:
            engine.sleep(msg.level)
        else:
            engine.wake_up(msg.tags)
    except SleepRefused as e:
        return SleepStatus(nonce=msg.nonce, stage_id=stage_id, sleeping=engine.sleeping, error=str(e), busy=True)
    except Exception as e:  # noqa: BLE001 - e.g. no memory to wake up in: the stage stays as it is and says why
        logger.exception("stage %d: %s failed", stage_id, "sleep" if msg.sleep else "wake up")
        return SleepStatus(nonce=msg.nonce, stage_id=stage_id, sleeping=engine.sleeping,
                           error=f"{type(e).__name__}: {e}")
    return SleepStatus(nonce=msg.nonce, stage_id=stage_id, sleeping=engine.sleeping)


class _Terminated(BaseException):
    """SIGTERM in a headless replica: unwinds the worker (not caught as an Exception) so that it
    leaves the head cleanly."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _heartbeat_loop(ctx: zmq.Context, spec: WorkerSpec, stop: threading.Event) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if spec.remote is not None:
        secure_client(sock, spec.remote.keys)
    sock.connect(spec.out_addr)
    codec = MessageCodec(Heartbeat, spec.shm_threshold_bytes, spec.shm_prefix)
    beat = codec.encode(Heartbeat(spec.stage_id, os.getpid()))
    try:
        while True:
            sock.send_multipart(beat)
            if stop.wait(spec.heartbeat_interval_s):
                return
    finally:
        sock.close()
