"""Per-device init locks that serialize stage initialization across processes (spec 002)."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import vllm_omni.envs as envs
from vllm_omni.engine.stage_init.devices import DEVICE_ENV_VAR
from vllm_omni.engine.stage_init.readers import foreign_field, positive_int, split_csv

logger = logging.getLogger(__name__)

_LOCK_POLL_S = 0.05


def _lock_dir() -> str:
    path = envs.LOCK_DIR.get() or os.path.join(tempfile.gettempdir(), "vllm_omni_locks")
    try:
        os.makedirs(path)
        # GPUs are shared by every user of the host, so the lock dir must be too
        # (sticky, like /tmp, so nobody can delete another user's lock file).
        os.chmod(path, 0o1777)
    except FileExistsError:
        pass
    return path


def _devices_needed(engine_args: Mapping[str, Any], stage_id: int) -> int:
    parallel_config = engine_args.get("parallel_config")
    world_size = foreign_field(parallel_config, "world_size")
    if world_size is not None:
        return positive_int(world_size, 1, f"Stage {stage_id}: parallel_config.world_size")
    n = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        n *= positive_int(engine_args.get(key), 1, f"Stage {stage_id}: {key}")
    return n


def _lock_holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def acquire_device_locks(
    stage_id: int,
    engine_args_dict: Mapping[str, Any],
    stage_init_timeout: float,
) -> list[int]:
    """Take an exclusive init lock on every device this stage will use.

    The lock serializes stage *initialization* per device, so two stages that
    share a GPU do not profile free memory while the other is allocating.

    Call it with the stage's device visibility already applied: the devices are
    the first N entries of CUDA_VISIBLE_DEVICES (physical ids, so the lock is
    the same for every process on the host), or ``0..N-1`` when it is unset; N
    is ``parallel_config.world_size`` if given, else TP x PP x DP from the
    engine args. Locks are taken in sorted order (no deadlock between stages
    with overlapping device sets) and retried without blocking until
    ``stage_init_timeout`` seconds have passed overall; then TimeoutError names
    the stage, the device and the holder's pid, and the locks taken so far are
    released. Returns the lock fds for ``release_device_locks``.
    """
    needed = _devices_needed(engine_args_dict, stage_id)
    visible = os.environ.get(DEVICE_ENV_VAR)
    devices = split_csv(visible) if visible is not None else [str(i) for i in range(needed)]
    if not devices:  # CUDA_VISIBLE_DEVICES="" hides every GPU: a CPU stage, nothing to serialize
        return []
    if len(devices) < needed:
        raise RuntimeError(
            f"Stage {stage_id} needs {needed} device(s) but {DEVICE_ENV_VAR}={visible!r} "
            f"makes only {len(devices)} visible"
        )
    devices = sorted(set(devices[:needed]), key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d))
    lock_dir = _lock_dir()
    deadline = time.monotonic() + max(0.0, float(stage_init_timeout))
    fds: list[int] = []
    try:
        for device in devices:
            path = os.path.join(lock_dir, "device_" + re.sub(r"[^A-Za-z0-9_.-]", "_", device) + ".lock")
            fds.append(_lock_file(path, deadline, stage_id, device, stage_init_timeout))
    except BaseException:
        release_device_locks(fds)
        raise
    logger.debug("Stage %s holds init locks on devices %s", stage_id, devices)
    return fds


def _lock_file(path: str, deadline: float, stage_id: int, device: str, timeout: float) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"Stage {stage_id}: timed out after {timeout}s waiting for the init lock of device "
                    f"{device} ({path}, held by pid {_lock_holder(path)})"
                )
            time.sleep(min(_LOCK_POLL_S, remaining))
        # The pid in the file is only for the error message of the next waiter.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def release_device_locks(lock_fds: Sequence[int]) -> None:
    """Release locks from ``acquire_device_locks``: unlock and close each fd.

    Keeps going past a bad fd so one failure cannot leave other devices locked.
    """
    for fd in lock_fds:
        for release in (lambda: fcntl.flock(fd, fcntl.LOCK_UN), lambda: os.close(fd)):
            try:
                release()
            except OSError as e:
                logger.warning("releasing device init lock fd %s failed: %s", fd, e)


def acquire_diffusion_device_locks(stage_id: int, od_config: Any, stage_init_timeout: float) -> list[int]:
    """Init locks for a diffusion stage, sized by its ``parallel_config.world_size`` (upstream's
    diffusion config). Our stage workers lock every stage, diffusion too, with
    ``acquire_device_locks`` sized by ``get_stage_devices_per_replica`` (engine/stage_worker.py)."""
    world_size = foreign_field(foreign_field(od_config, "parallel_config"), "world_size")
    return acquire_device_locks(stage_id, {"parallel_config": {"world_size": world_size or 1}}, stage_init_timeout)
