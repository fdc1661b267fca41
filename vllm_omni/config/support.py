"""What this build's engines can run, checked when the config is parsed.

A valid config can still ask for something no stage here can do (stage replicas) or name a
device the machine does not have. Each of these would
fail only after the stage processes spawn, with a traceback; here it is a ConfigError naming
the file, the stage and the field, raised by the loader and by `vllm-omni check-config`.
Each check goes away with the issue that implements the feature.
"""
from __future__ import annotations

from collections.abc import Callable

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import StageConfig

SourceOf = Callable[[str], str]  # canonical path -> the layer that set it


def check_stage_supported(stage: StageConfig, source_of: SourceOf) -> None:
    replicas = stage.runtime.num_replicas
    if replicas != 1:
        raise ConfigError("stage replicas are not supported yet (one replica per stage)",
                          source=source_of("runtime.num_replicas"), stage_id=stage.stage_id,
                          field="runtime.num_replicas", value=replicas, allowed="1")


def check_devices_exist(stage: StageConfig, num_devices: int, source_of: SourceOf) -> None:
    """`runtime.devices` are indices into the devices this process sees (CUDA_VISIBLE_DEVICES)."""
    missing = [d for d in stage.runtime.device_ids if d >= num_devices]
    if missing:
        visible = f"{num_devices} visible ({', '.join(map(str, range(num_devices)))})" if num_devices else "none visible"
        raise ConfigError(f"device {missing[0]} does not exist on this machine: {visible}",
                          source=source_of("runtime.devices"), stage_id=stage.stage_id, field="runtime.devices",
                          value=stage.runtime.devices,
                          allowed=f"indices below {num_devices}" if num_devices else "a machine with a GPU")
