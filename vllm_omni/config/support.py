"""What this build's engines can run, checked when the config is parsed.

A valid config can still name a device the machine does not have (replicas included: in
spec 002's template mode each replica takes the next devices). That would fail only after
the stage processes spawn, with a traceback; here it is a ConfigError naming the file, the
stage and the field, raised by the loader and by `vllm-omni check-config`.
"""
from __future__ import annotations

from collections.abc import Callable

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import StageConfig

SourceOf = Callable[[str], str]  # canonical path -> the layer that set it


def check_devices_exist(stage: StageConfig, num_devices: int, source_of: SourceOf) -> None:
    """`runtime.devices` are indices into the devices this process sees (CUDA_VISIBLE_DEVICES)."""
    missing = [d for d in _replica_device_ids(stage) if d >= num_devices]
    if missing:
        visible = f"{num_devices} visible ({', '.join(map(str, range(num_devices)))})" if num_devices else "none visible"
        raise ConfigError(f"device {missing[0]} does not exist on this machine: {visible}",
                          source=source_of("runtime.devices"), stage_id=stage.stage_id, field="runtime.devices",
                          value=stage.runtime.devices,
                          allowed=f"indices below {num_devices}" if num_devices else "a machine with a GPU")


def _replica_device_ids(stage: StageConfig) -> tuple[int, ...]:
    """The device indices a stage's replicas use: `runtime.devices` as listed (one replica, or
    spec 002's pool mode), or, in template mode, one replica's shape shifted per replica."""
    ids, replicas = stage.runtime.device_ids, stage.runtime.num_replicas
    per_replica = stage.engine_args.devices_per_replica
    if replicas == 1 or len(ids) == replicas * per_replica:
        return ids
    return tuple(r * per_replica + d for r in range(replicas) for d in ids)
