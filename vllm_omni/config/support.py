"""What this build's engines can run, checked when the config is parsed.

A valid config can still ask for something no stage here can do (tensor parallelism, stage
replicas, streaming edges) or name a device the machine does not have. Each of these would
fail only after the stage processes spawn, with a traceback; here it is a ConfigError naming
the file, the stage and the field, raised by the loader and by `vllm-omni check-config`.
Each check goes away with the issue that implements the feature.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import EdgeConfig, StageConfig

SourceOf = Callable[[str], str]  # canonical path -> the layer that set it


def check_stage_supported(stage: StageConfig, source_of: SourceOf) -> None:
    tp = stage.engine_args.tensor_parallel_size
    if tp != 1:
        raise ConfigError(f"tensor_parallel_size={tp} is not supported yet (tensor parallelism is the scale-out "
                          "issue): each stage runs on one device", source=source_of("engine_args.tensor_parallel_size"),
                          stage_id=stage.stage_id, field="engine_args.tensor_parallel_size", value=tp,
                          allowed="1, with one device in runtime.devices")
    replicas = stage.runtime.num_replicas
    if replicas != 1:
        raise ConfigError("stage replicas are not supported yet (one replica per stage)",
                          source=source_of("runtime.num_replicas"), stage_id=stage.stage_id,
                          field="runtime.num_replicas", value=replicas, allowed="1")


def check_edges_supported(edges: Sequence[EdgeConfig], *, source: str) -> None:
    for edge in edges:
        if edge.window_size != -1:
            raise ConfigError("is not supported yet: the downstream stage starts after the upstream one finishes",
                              source=source, field=f"edge {edge.from_stage} -> {edge.to_stage} window_size",
                              value=edge.window_size, allowed="-1")


def check_devices_exist(stage: StageConfig, num_devices: int, source_of: SourceOf) -> None:
    """`runtime.devices` are indices into the devices this process sees (CUDA_VISIBLE_DEVICES)."""
    missing = [d for d in stage.runtime.device_ids if d >= num_devices]
    if missing:
        visible = f"{num_devices} visible ({', '.join(map(str, range(num_devices)))})" if num_devices else "none visible"
        raise ConfigError(f"device {missing[0]} does not exist on this machine: {visible}",
                          source=source_of("runtime.devices"), stage_id=stage.stage_id, field="runtime.devices",
                          value=stage.runtime.devices,
                          allowed=f"indices below {num_devices}" if num_devices else "a machine with a GPU")
