"""Stage initialization helpers for the multi-stage runtime (spec 002).

Orchestration-level init logic that the engine's launcher shares between the
local, in-process and headless paths: init plans, stage metadata extraction,
device splitting for replicas, device locks, per-stage runtime env, death
signal, process termination, and the normalized per-stage engine args dict.

Stage configs are read duck-typed (attributes or mapping keys named after the
spec 000 YAML fields), because callers pass both the frozen dataclasses of
``vllm_omni.config`` and plain dicts/objects (tests, headless registration).
Nothing here imports torch: stage workers import this module before they
choose their devices.

Intentionally absent (upstream builds vLLM objects there; our engine builds its
own config from ``build_engine_args_dict``): ``build_vllm_config``,
``build_stage0_input_processor``, ``build_llm_stage_output_processor``,
``initialize_diffusion_stage``, ``build_diffusion_config``,
``patch_generation_config_if_needed``, ``load_omni_transfer_config_for_model``,
``capture_stage_factory_contexts``.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import errno
import fcntl
import importlib
import logging
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

AR_WORKER_CLS = "vllm_omni.worker.gpu_ar_worker.GPUARWorker"
GENERATION_WORKER_CLS = "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"
_WORKER_CLS_BY_TYPE = {"ar": AR_WORKER_CLS, "generation": GENERATION_WORKER_CLS}

DEVICE_ENV_VAR = "CUDA_VISIBLE_DEVICES"
LOCK_DIR_ENV_VAR = "VLLM_OMNI_LOCK_DIR"
_LOCK_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


# --------------------------------------------------------------------------- plans


@dataclass
class ReplicaInitPlan:
    """One concrete replica startup unit within a logical stage."""

    replica_id: int
    num_replicas: int
    launch_mode: str
    metadata: Any
    stage_cfg: Any
    stage_connector_spec: dict[str, Any]
    omni_kv_connector: tuple[dict[str, Any] | None, str | None, str | None]
    stage_vllm_config: Any | None = None
    executor_class: type | None = None


@dataclass
class LogicalStageInitPlan:
    """Startup plan for one logical stage."""

    stage_idx: int
    configured_stage_id: int
    replicas: list[ReplicaInitPlan]


@dataclass
class StageMetadata:
    """Lightweight stage attributes extracted from a stage config."""

    stage_id: int
    stage_type: Literal["llm", "diffusion"]
    engine_output_type: str | None
    is_comprehension: bool
    requires_multimodal_data: bool
    engine_input_source: list[int]
    final_output: bool
    final_output_type: str | None
    default_sampling_params: Any  # OmniSamplingParams: owned by the config layer
    custom_process_input_func: Callable | None
    model_stage: str | None
    runtime_cfg: Any
    prompt_expand_func: Callable | None = None
    cfg_kv_collect_func: Callable | None = None
    # Distinguishes replicas of one logical stage; 0 for single-replica stages.
    replica_id: int = 0


@dataclass
class StageRemoteFactoryContext:
    """Per-stage context cached by the engine for dynamic replica attach.

    Captured once from the per-stage init plans; used to build the head-side
    stage client when a headless replica of this stage registers later.
    """

    stage_id: int
    stage_type: str
    stage_cfg: Any
    base_metadata: Any
    # LLM-only fields:
    vllm_config: Any | None = None
    executor_class: type | None = None
    # Diffusion-only fields:
    diffusion_batch_size: int = 1


# --------------------------------------------------------------------------- small readers


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a mapping or an object; ``default`` when absent."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _as_dict(obj: Any) -> dict[str, Any]:
    """A detached dict copy of a dataclass, mapping or plain object.

    Copies deeply so that callers may edit the result without touching the
    (possibly frozen, possibly shared) config it came from.
    """
    if obj is None:
        return {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return copy.deepcopy(dict(obj))
    if hasattr(obj, "__dict__"):
        return {k: copy.deepcopy(v) for k, v in vars(obj).items() if not k.startswith("_")}
    raise TypeError(f"cannot read {type(obj).__name__} as a dict of fields")


def _split_csv(value: Any) -> list[str]:
    """Device lists arrive as "0,1", as a bare YAML int (``devices: 0``) or as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [p.strip() for p in str(value).split(",") if p.strip()]


def _positive_int(value: Any, default: int, what: str) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is invalid: must be an integer >= 1") from None
    if n < 1:
        raise ValueError(f"{what}={value!r} is invalid: must be an integer >= 1")
    return n


def import_dotted(path: str) -> Any:
    """Import ``"package.module.attr"`` (or ``"package.module:Class.attr"``) and return the attr.

    Errors name the path, so a typo in a YAML ``custom_process_input_func``
    is found from the message alone.
    """
    if not isinstance(path, str) or "." not in path.replace(":", "."):
        raise ValueError(f"dotted path {path!r} is invalid: must look like 'package.module.attr'")
    path = path.strip()
    module_name, attr_path = path.split(":", 1) if ":" in path else path.rsplit(".", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import {path!r}: module {module_name!r} failed to import: {e}") from e
    try:
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except AttributeError as e:
        raise ImportError(f"cannot import {path!r}: module {module_name!r} has no attribute {attr_path!r}") from e
    return obj


def _resolve_callable(value: Any, stage_id: Any, field_name: str) -> Callable | None:
    if value is None or value == "":
        return None
    fn = value if callable(value) else import_dotted(value)
    if not callable(fn):
        raise TypeError(f"Stage {stage_id}: {field_name}={value!r} resolved to a non-callable {type(fn).__name__}")
    return fn


# --------------------------------------------------------------------------- metadata


def extract_stage_metadata(stage_config: Any) -> StageMetadata:
    """Pure data extraction from a stage config object.

    Documented defaults are the config layer's job; the fallbacks here only
    cover objects that lack a field entirely. ``default_sampling_params`` is
    passed through as the config layer parsed it. Dotted function paths are
    resolved to callables.
    """
    stage_id = _field(stage_config, "stage_id")
    if stage_id is None:
        raise ValueError("stage config has no stage_id")
    stage_type = _stage_type(stage_config)
    if stage_type not in ("llm", "diffusion"):
        raise ValueError(f"Stage {stage_id}: stage_type={stage_type!r} is invalid: must be 'llm' or 'diffusion'")
    engine_args = _field(stage_config, "engine_args")
    runtime_cfg = _field(stage_config, "runtime")
    requires_mm = _field(stage_config, "requires_multimodal_data", None)
    if requires_mm is None:  # older configs put it under runtime
        requires_mm = _field(runtime_cfg, "requires_multimodal_data", False)
    return StageMetadata(
        stage_id=int(stage_id),
        stage_type=stage_type,
        engine_output_type=_field(engine_args, "engine_output_type"),
        is_comprehension=bool(_field(stage_config, "is_comprehension", False)),
        requires_multimodal_data=bool(requires_mm),
        engine_input_source=[int(s) for s in (_field(stage_config, "engine_input_source") or [])],
        final_output=bool(_field(stage_config, "final_output", False)),
        final_output_type=_field(stage_config, "final_output_type"),
        default_sampling_params=_field(stage_config, "default_sampling_params"),
        custom_process_input_func=_resolve_callable(
            _field(stage_config, "custom_process_input_func"), stage_id, "custom_process_input_func"
        ),
        model_stage=_field(engine_args, "model_stage"),
        runtime_cfg=runtime_cfg,
        prompt_expand_func=_resolve_callable(
            _field(stage_config, "prompt_expand_func"), stage_id, "prompt_expand_func"
        ),
        cfg_kv_collect_func=_resolve_callable(
            _field(stage_config, "cfg_kv_collect_func"), stage_id, "cfg_kv_collect_func"
        ),
    )


def _stage_type(stage_cfg: Any) -> str:
    stage_type = _field(stage_cfg, "stage_type", None) or "llm"
    return getattr(stage_type, "value", stage_type)  # the config layer may use an enum


def get_stage_tp_size(stage_cfg: Any) -> int:
    """``engine_args.tensor_parallel_size`` of a stage config (1 when absent or None)."""
    tp = _field(_field(stage_cfg, "engine_args"), "tensor_parallel_size")
    return _positive_int(tp, 1, f"Stage {_field(stage_cfg, 'stage_id')}: engine_args.tensor_parallel_size")


def get_stage_devices_per_replica(stage_cfg: Any) -> int:
    """Devices one replica of ``stage_cfg`` occupies.

    LLM stages: their TP size. Diffusion stages: ``engine_args.parallel_config.
    world_size`` when present (their parallelism is not TP-shaped), else TP size.
    """
    if _stage_type(stage_cfg) == "diffusion":
        parallel_config = _field(_field(stage_cfg, "engine_args"), "parallel_config")
        world_size = _field(parallel_config, "world_size")
        if world_size is not None:
            what = f"Stage {_field(stage_cfg, 'stage_id')}: engine_args.parallel_config.world_size"
            return _positive_int(world_size, 1, what)
    return get_stage_tp_size(stage_cfg)


# --------------------------------------------------------------------------- replica layout


def split_devices_for_replicas(
    devices_str: str | None,
    num_replicas: int,
    tp_size: int,
    stage_id: int,
) -> list[str | None]:
    """Split a stage's devices string into one device string per replica.

    ``num_replicas == 1`` returns ``[devices_str]`` unchanged. Otherwise:

    1. Pool mode, ``len(devices) == num_replicas * tp_size``: replica r gets
       entries ``[r*tp_size, (r+1)*tp_size)``.
       ``("1,2,3,4", 2, 2, 1) -> ["1,2", "3,4"]``
    2. Template mode, ``len(devices) == tp_size``: the string is one replica's
       shape, entries in ``[0, tp_size)``; replica r gets ``r*tp_size + a``.
       ``("0,1", 4, 2, 1) -> ["0,1", "2,3", "4,5", "6,7"]`` - the same YAML
       works for any replica count because the launcher's
       CUDA_VISIBLE_DEVICES scales, not the YAML.

    Values are logical indices into the launcher's CUDA_VISIBLE_DEVICES. The
    two modes are length-disjoint for ``num_replicas > 1``; any other length
    raises ValueError. ``devices_str=None`` (no explicit placement) gives
    ``None`` for every replica, since callers index the result by replica id.
    """
    if num_replicas == 1:
        return [devices_str]
    if num_replicas < 0:
        raise ValueError(f"Stage {stage_id}: num_replicas={num_replicas} is invalid: must be >= 0")
    if num_replicas == 0:
        return []
    tp_size = _positive_int(tp_size, 1, f"Stage {stage_id}: tensor_parallel_size")
    if devices_str is None:
        return [None] * num_replicas
    entries = _split_csv(devices_str)
    pool_len = num_replicas * tp_size
    if len(entries) == pool_len:
        groups = [entries[r * tp_size : (r + 1) * tp_size] for r in range(num_replicas)]
    elif len(entries) == tp_size:
        groups = [[str(r * tp_size + a) for a in _template_offsets(entries, tp_size, devices_str, stage_id)]
                  for r in range(num_replicas)]
    else:
        raise ValueError(
            f"Stage {stage_id}: devices={devices_str!r} has {len(entries)} entries; with "
            f"num_replicas={num_replicas} and tensor_parallel_size={tp_size} it must have either "
            f"{tp_size} (template mode, one replica's shape) or {pool_len} (pool mode, all replicas)"
        )
    for r, group in enumerate(groups):
        if len(set(group)) != len(group):
            raise ValueError(
                f"Stage {stage_id}: devices={devices_str!r} gives replica {r} the devices {group}, "
                f"which repeat a device; each rank of a replica needs its own device"
            )
    return [",".join(g) for g in groups]


def _template_offsets(entries: list[str], tp_size: int, devices_str: str, stage_id: int) -> list[int]:
    try:
        offsets = [int(e) for e in entries]
    except ValueError:
        raise ValueError(
            f"Stage {stage_id}: devices={devices_str!r} in template mode must be integers in [0, {tp_size})"
        ) from None
    bad = [a for a in offsets if not 0 <= a < tp_size]
    if bad:
        raise ValueError(
            f"Stage {stage_id}: devices={devices_str!r} in template mode has entries {bad} "
            f"outside [0, {tp_size}) (tensor_parallel_size={tp_size})"
        )
    return offsets


def compute_replica_layout(
    stage_configs: Sequence[Any],
    *,
    allow_zero: bool = False,
) -> tuple[list[int], dict[int, list[str | None]]]:
    """Per-stage replica counts and, for stages with > 1 replica, per-replica devices.

    ``runtime.num_replicas`` defaults to 1. ``allow_zero=True`` keeps a 0
    (head-distributed mode: the stage is filled later by headless replicas);
    otherwise counts are clamped to >= 1. The devices map is keyed by the
    stage's position in ``stage_configs`` and split with one replica's device
    count (``get_stage_devices_per_replica``, the TP size for LLM stages).
    """
    replicas_per_stage: list[int] = []
    replica_devices_map: dict[int, list[str | None]] = {}
    for idx, stage_cfg in enumerate(stage_configs):
        stage_id = _field(stage_cfg, "stage_id", idx)
        runtime_cfg = _field(stage_cfg, "runtime")
        raw = _field(runtime_cfg, "num_replicas")
        try:
            num_replicas = 1 if raw is None else int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"Stage {stage_id}: runtime.num_replicas={raw!r} is invalid: must be an integer") from None
        if num_replicas < 0:
            raise ValueError(f"Stage {stage_id}: runtime.num_replicas={num_replicas} is invalid: must be >= 0")
        if not allow_zero:
            num_replicas = max(1, num_replicas)
        replicas_per_stage.append(num_replicas)
        if num_replicas > 1:
            per_replica = get_stage_devices_per_replica(stage_cfg)
            devices = _field(runtime_cfg, "devices")
            replica_devices_map[idx] = split_devices_for_replicas(
                None if devices is None else ",".join(_split_csv(devices)), num_replicas, per_replica, stage_id
            )
            logger.info("Stage %s: %d replicas x %d devices: %s", stage_id, num_replicas, per_replica,
                        replica_devices_map[idx])
    return replicas_per_stage, replica_devices_map


# --------------------------------------------------------------------------- device locks


def _lock_dir() -> str:
    path = os.environ.get(LOCK_DIR_ENV_VAR) or os.path.join(tempfile.gettempdir(), "vllm_omni_locks")
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
    world_size = _field(parallel_config, "world_size")
    if world_size is not None:
        return _positive_int(world_size, 1, f"Stage {stage_id}: parallel_config.world_size")
    n = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        n *= _positive_int(engine_args.get(key), 1, f"Stage {stage_id}: {key}")
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
    devices = _split_csv(visible) if visible is not None else [str(i) for i in range(needed)]
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
    """Init locks for a diffusion stage, sized by its ``parallel_config.world_size``."""
    world_size = _field(_field(od_config, "parallel_config"), "world_size")
    return acquire_device_locks(stage_id, {"parallel_config": {"world_size": world_size or 1}}, stage_init_timeout)


# --------------------------------------------------------------------------- runtime env / devices


def _env_value(value: Any) -> str:
    # YAML gives bools and ints; env flags conventionally read "1"/"0".
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@contextlib.contextmanager
def stage_runtime_env(stage_id: int, runtime_cfg: Any) -> Iterator[None]:
    """Apply ``runtime.env`` to os.environ for the block; restore exactly on exit.

    A value of None unsets the variable inside the block. Variables that did
    not exist before are removed again on exit, also when the block raises.
    """
    env = _field(runtime_cfg, "env") or {}
    if not isinstance(env, Mapping):
        raise ValueError(f"Stage {stage_id}: runtime.env must be a mapping of names to values, "
                         f"got {type(env).__name__}")
    saved = {str(k): os.environ.get(str(k)) for k in env}
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(str(key), None)
            else:
                os.environ[str(key)] = _env_value(value)
        if env:
            logger.debug("Stage %s runtime env: %s", stage_id, sorted(saved))
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _physical_devices(stage_id: int, devices: Any) -> str | None:
    """Map ``runtime.devices`` (logical indices) through the launcher's CUDA_VISIBLE_DEVICES."""
    entries = _split_csv(devices)
    if not entries:
        return None
    launcher = os.environ.get(DEVICE_ENV_VAR)
    if launcher is None:  # nothing narrowed yet: logical == physical
        return ",".join(entries)
    pool = _split_csv(launcher)
    mapped = []
    for entry in entries:
        try:
            idx = int(entry)
        except ValueError:
            raise ValueError(f"Stage {stage_id}: runtime.devices={devices!r} must be integer indices") from None
        if not 0 <= idx < len(pool):
            raise ValueError(
                f"Stage {stage_id}: runtime.devices={devices!r} uses index {idx}, but "
                f"{DEVICE_ENV_VAR}={launcher!r} makes only {len(pool)} device(s) visible"
            )
        mapped.append(pool[idx])
    return ",".join(mapped)


def setup_stage_devices(stage_id: int, runtime_cfg: Any) -> None:
    """Narrow CUDA_VISIBLE_DEVICES to the stage's ``runtime.devices`` (no-op when unset).

    Not undone here: whoever owns the process (a stage child) keeps it, and an
    in-process launcher saves/restores CUDA_VISIBLE_DEVICES around the call.
    """
    physical = _physical_devices(stage_id, _field(runtime_cfg, "devices"))
    if physical is not None:
        os.environ[DEVICE_ENV_VAR] = physical
        logger.info("Stage %s: %s=%s", stage_id, DEVICE_ENV_VAR, physical)


@contextlib.contextmanager
def stage_runtime_setup(stage_id: int, runtime_cfg: Any) -> Iterator[None]:
    """Apply ``runtime.env`` and ``runtime.devices`` for the block.

    ``runtime.env`` is restored on exit. Device visibility restore remains the
    caller's responsibility (save/restore CUDA_VISIBLE_DEVICES around this
    block when launching in-process). The env is applied first, so a
    CUDA_VISIBLE_DEVICES set in ``runtime.env`` is the pool ``runtime.devices``
    indexes into, and it is restored along with the rest of the env.
    """
    with stage_runtime_env(stage_id, runtime_cfg):
        setup_stage_devices(stage_id, runtime_cfg)
        yield


# --------------------------------------------------------------------------- processes


def set_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (best effort).

    Uses prctl(PR_SET_PDEATHSIG); a no-op on other platforms and never raises.
    Note the kernel fires it when the parent *thread* that created this process
    exits, and not at all if the parent died before this call.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG, %s) failed: %s", sig, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError, TypeError, ValueError) as e:
        logger.warning("cannot set the parent-death signal: %s", e)


def terminate_alive_proc(proc: mp.Process | subprocess.Popen, timeout: float = 5) -> None:
    """Stop ``proc``: SIGTERM, wait up to ``timeout`` s, then SIGKILL and reap.

    Accepts ``multiprocessing.Process`` and ``subprocess.Popen``; no-op when
    the process has already exited.
    """
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("pid %s ignored SIGTERM for %ss; killing it", proc.pid, timeout)
            proc.kill()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # e.g. stuck in uninterruptible I/O
                logger.error("pid %s still alive %ss after SIGKILL", proc.pid, timeout)
        return
    if not proc.is_alive():
        return
    proc.terminate()
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("pid %s ignored SIGTERM for %ss; killing it", proc.pid, timeout)
        proc.kill()
        proc.join(timeout)


def prepare_engine_environment() -> None:
    """One-time global setup: the ``spawn`` start method for stage processes.

    CUDA cannot be used in a forked child, so stages must be spawned. Sets it
    only when no start method was chosen yet (idempotent); an explicit other
    choice is left alone with a warning. (Upstream also loads plugins here; we
    have no plugin system: user code comes in through dotted paths.)
    """
    current = mp.get_start_method(allow_none=True)
    if current is None:
        mp.set_start_method("spawn")
    elif current != "spawn":
        logger.warning("multiprocessing start method is %r; stage processes need 'spawn' to use CUDA", current)


# --------------------------------------------------------------------------- engine args


def resolve_worker_cls(engine_args: MutableMapping[str, Any]) -> None:
    """Fill ``worker_cls`` from ``worker_type`` (ar / generation) unless set explicitly."""
    worker_type = engine_args.get("worker_type")
    if not worker_type or engine_args.get("worker_cls") not in (None, "", "auto"):
        return
    key = str(getattr(worker_type, "value", worker_type)).lower()
    if key not in _WORKER_CLS_BY_TYPE:
        raise ValueError(
            f"engine_args.worker_type={worker_type!r} is invalid: must be one of {sorted(_WORKER_CLS_BY_TYPE)}"
        )
    engine_args["worker_cls"] = _WORKER_CLS_BY_TYPE[key]


def apply_cli_tokenizer(
    engine_args: MutableMapping[str, Any],
    *,
    cli_tokenizer: str | None,
    stage_defines_tokenizer: bool,
) -> None:
    """Forward the CLI ``--tokenizer`` unless the stage config defines its own."""
    if cli_tokenizer is not None and not stage_defines_tokenizer:
        engine_args["tokenizer"] = cli_tokenizer


def get_stage_connector_spec(omni_transfer_config: Any, stage_id: int, async_chunk: bool) -> dict[str, Any]:
    """The connector spec of the first edge into ``stage_id`` when async chunking is on.

    ``omni_transfer_config.connectors`` (attribute or key) maps
    ``(from_stage, to_stage)`` to a spec with ``name`` and ``extra`` (object
    or dict). Returns ``{"name": ..., "extra": {...}}``, or ``{}`` when async
    chunking is off or no edge reaches the stage.
    """
    if not async_chunk or omni_transfer_config is None:
        return {}
    connectors = _field(omni_transfer_config, "connectors") or {}
    for (_src, dst), spec in connectors.items():
        if str(dst) == str(stage_id):
            return {"name": _field(spec, "name"), "extra": dict(_field(spec, "extra") or {})}
    return {}


def build_engine_args_dict(
    stage_config: Any,
    model: str,
    stage_connector_spec: dict[str, Any] | None = None,
    cli_tokenizer: str | None = None,
) -> dict[str, Any]:
    """The normalized engine args dict for one stage (a detached copy).

    Sets ``model`` and ``stage_id`` (the stage's own, never an inherited CLI
    value), resolves ``worker_cls`` for non-diffusion stages, forwards the CLI
    tokenizer when the stage has none, and attaches ``stage_connector_spec``
    when given. A None ``tensor_parallel_size`` is dropped so the engine's
    default applies.
    """
    engine_args = _as_dict(_field(stage_config, "engine_args"))
    if "tensor_parallel_size" in engine_args and engine_args["tensor_parallel_size"] is None:
        del engine_args["tensor_parallel_size"]
    apply_cli_tokenizer(
        engine_args,
        cli_tokenizer=cli_tokenizer,
        stage_defines_tokenizer=engine_args.get("tokenizer") is not None,
    )
    engine_args["model"] = model
    engine_args["stage_id"] = _field(stage_config, "stage_id")
    if _stage_type(stage_config) != "diffusion":
        resolve_worker_cls(engine_args)
    if stage_connector_spec is not None:
        engine_args["stage_connector_spec"] = dict(stage_connector_spec)
    return engine_args


def _find_stage(stage_configs: Sequence[Any], stage_id: Any) -> Any | None:
    for cfg in stage_configs:
        if str(_field(cfg, "stage_id")) == str(stage_id):
            return cfg
    return None


def inject_kv_stage_info(
    stage_cfg: Any,
    stage_id: int,
    stage_configs: Sequence[Any] | None = None,
) -> dict[str, Any] | None:
    """Fill ``engine_args.omni_kv_config`` with this stage's identity and TP topology.

    Adds (without overriding user-authored values) ``stage_id``,
    ``engine_input_source`` and, when ``stage_configs`` is given,
    ``rank_mapping.from_tp`` / ``rank_mapping.to_tp`` from the sending and the
    receiving stage's TP sizes, so heterogeneous TP needs no hand-written
    rank mapping. The peer is ``omni_from_stage`` / ``omni_to_stage`` when the
    config names this stage as one end, else the first ``engine_input_source``.

    Returns the filled dict, or None when the stage has no ``omni_kv_config``.
    A mutable dict is filled in place; anything else (a frozen config, a
    read-only mapping) is copied, written back where the engine args allow it,
    and the caller must use the returned dict.
    """
    engine_args = _field(stage_cfg, "engine_args")
    kv = _field(engine_args, "omni_kv_config")
    if kv is None:
        return None
    target = kv if isinstance(kv, MutableMapping) else _as_dict(kv)
    target.setdefault("stage_id", stage_id)
    sources = [int(s) for s in (_field(stage_cfg, "engine_input_source") or [])]
    if sources:
        target.setdefault("engine_input_source", sources)
    if stage_configs:
        _infer_tp_topology(target, stage_cfg, stage_id, sources, stage_configs)
    if target is not kv:
        _write_back(engine_args, target, stage_id)
    return target


def _infer_tp_topology(kv: MutableMapping[str, Any], stage_cfg: Any, stage_id: int, sources: list[int],
                       stage_configs: Sequence[Any]) -> None:
    own_tp = get_stage_tp_size(stage_cfg)
    from_stage, to_stage = kv.get("omni_from_stage"), kv.get("omni_to_stage")
    if from_stage is not None and str(from_stage) == str(stage_id):
        peer, from_is_peer = to_stage, False
    elif to_stage is not None and str(to_stage) == str(stage_id):
        peer, from_is_peer = from_stage, True
    elif sources:
        peer, from_is_peer = sources[0], True
    else:
        return
    peer_cfg = None if peer is None else _find_stage(stage_configs, peer)
    if peer_cfg is None:
        return
    peer_tp = get_stage_tp_size(peer_cfg)
    rank_mapping = kv.get("rank_mapping")
    rank_mapping = dict(rank_mapping) if isinstance(rank_mapping, Mapping) else {}
    rank_mapping.setdefault("from_tp", peer_tp if from_is_peer else own_tp)
    rank_mapping.setdefault("to_tp", own_tp if from_is_peer else peer_tp)
    kv["rank_mapping"] = rank_mapping


def _write_back(engine_args: Any, kv: dict[str, Any], stage_id: int) -> None:
    if isinstance(engine_args, MutableMapping):
        engine_args["omni_kv_config"] = kv
        return
    try:
        setattr(engine_args, "omni_kv_config", kv)
    except (AttributeError, dataclasses.FrozenInstanceError):
        logger.debug("Stage %s: engine args are frozen; omni_kv_config returned, not stored", stage_id)
