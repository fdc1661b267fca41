"""Device placement: per-replica device counts, replica layout and stage device visibility (spec 002)."""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from vllm_omni.engine.stage_init.readers import RuntimeView, StageView, positive_int, split_csv

logger = logging.getLogger(__name__)

DEVICE_ENV_VAR = "CUDA_VISIBLE_DEVICES"
_NVIDIA_DRIVER_DIR = "/proc/driver/nvidia"  # present where an NVIDIA driver is loaded (no CUDA init needed)


def get_stage_tp_size(stage_cfg: Any) -> int:
    """``engine_args.tensor_parallel_size`` of a stage config (1 when absent or None)."""
    stage = StageView.of(stage_cfg)
    return positive_int(stage.tensor_parallel_size, 1, f"Stage {stage.stage_id}: engine_args.tensor_parallel_size")


def get_stage_devices_per_replica(stage_cfg: Any) -> int:
    """Devices one replica of ``stage_cfg`` occupies.

    LLM stages: their TP size. Diffusion stages: ``engine_args.parallel_config.
    world_size`` when present (their parallelism is not TP-shaped), else TP size.
    """
    stage = StageView.of(stage_cfg)
    if stage.stage_type == "diffusion" and stage.world_size is not None:
        what = f"Stage {stage.stage_id}: engine_args.parallel_config.world_size"
        return positive_int(stage.world_size, 1, what)
    return get_stage_tp_size(stage_cfg)


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
    tp_size = positive_int(tp_size, 1, f"Stage {stage_id}: tensor_parallel_size")
    if devices_str is None:
        return [None] * num_replicas
    entries = split_csv(devices_str)
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

    Our fleet does not call it: it builds each stage's replica configs
    (``replica_pool.replica_configs``: typed StageConfigs carrying their devices
    and environment) with ``split_devices_for_replicas``, as this does; this
    index-keyed layout of every stage at once is upstream's shape.
    """
    replicas_per_stage: list[int] = []
    replica_devices_map: dict[int, list[str | None]] = {}
    for idx, stage_cfg in enumerate(stage_configs):
        stage = StageView.of(stage_cfg, default_id=idx)
        stage_id, raw = stage.stage_id, stage.runtime.num_replicas
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
            devices = stage.runtime.devices
            replica_devices_map[idx] = split_devices_for_replicas(
                None if devices is None else ",".join(split_csv(devices)), num_replicas, per_replica, stage_id
            )
            logger.info("Stage %s: %d replicas x %d devices: %s", stage_id, num_replicas, per_replica,
                        replica_devices_map[idx])
    return replicas_per_stage, replica_devices_map


def _physical_devices(stage_id: int, devices: Any) -> str | None:
    """Map ``runtime.devices`` (logical indices) through the launcher's CUDA_VISIBLE_DEVICES."""
    entries = split_csv(devices)
    if not entries:
        return None
    launcher = os.environ.get(DEVICE_ENV_VAR)
    if launcher is None:  # nothing narrowed yet: logical == physical
        return ",".join(entries)
    pool = split_csv(launcher)
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
    physical = _physical_devices(stage_id, RuntimeView.of(runtime_cfg).devices)
    if physical is not None:
        os.environ[DEVICE_ENV_VAR] = physical
        # Only worth a line where there are GPUs: on a CPU-only machine it reads like a fault.
        level = logging.INFO if os.path.isdir(_NVIDIA_DRIVER_DIR) else logging.DEBUG
        logger.log(level, "Stage %s: %s=%s", stage_id, DEVICE_ENV_VAR, physical)
