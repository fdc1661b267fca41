"""Upstream's parallel strategy files (`--strategy-config`, its examples' strategy_*.yaml): a
companion of a deploy config that sizes stages by role instead of by stage id.

    strategies:
      thinker:                      # a model_stage of the pipeline
        - axis: stage_replica       # N independent replicas of the stage
          size: 2
          routing: round_robin      # random | round_robin | least_queue
        - axis: tp                  # tensor parallelism inside the stage's engine
          size: 2

Read as upstream's translator reads it: `tp` sets the stage's tensor_parallel_size,
`stage_replica` its runtime.num_replicas, and its routing the replica load balancer (the
pipeline's lb_policy, as upstream's omni_lb_policy). The other axes upstream knows (`dp`, `pp`,
`ep`, and the diffusion ones it reserves) ask for parallelism this engine does not have: each is
refused by name, except a size of 1, which asks for nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_omni.config.errors import ConfigError, unknown_keys
from vllm_omni.config.layers import Layer, check_field
from vllm_omni.config.yaml_io import load_yaml_file
from vllm_omni.model_executor.models.families import canonical_stage

STRATEGY_KEY = "strategies"
_FIELD_OF = {"tp": "engine_args.tensor_parallel_size", "stage_replica": "runtime.num_replicas"}
_LB_POLICY = {"random": "random", "round_robin": "round-robin", "least_queue": "least-queue-length"}
_REFUSED = {"dp": "engine data parallelism is not supported; use a stage_replica axis for replicas",
            "pp": "pipeline parallelism is not supported", "ep": "expert parallelism is not supported"}
_ENTRY_KEYS = ("axis", "size", "routing", "l1_owner", "name")  # name: a label
_OWNER = {"tp": "engine", "stage_replica": "delegated"}  # who routes an axis' requests (upstream's l1_owner)
LB_POLICY_PATH = "strategy.lb_policy"  # a Layer.top path: the pipeline's replica routing


def is_strategy_data(data: dict[str, Any]) -> bool:
    return STRATEGY_KEY in data


def strategy_layer(path: str | Path, topology: Layer) -> Layer:
    """The strategy file's sizes as a layer over the pipeline whose stages `topology` lists."""
    source = str(path)
    data = load_yaml_file(Path(path))
    if unknown := [k for k in data if k != STRATEGY_KEY]:
        raise unknown_keys(unknown, (STRATEGY_KEY,), source=source)
    roles = data[STRATEGY_KEY]
    if not isinstance(roles, dict):
        raise ConfigError("must be a mapping of model_stage -> list of axes", source=source, field=STRATEGY_KEY,
                          value=roles)
    layer = Layer(source=source)
    for role, axes in roles.items():
        stage_ids = _stages_of(str(role), topology)
        if not stage_ids:
            raise ConfigError("names no stage of the pipeline", source=source, field=f"{STRATEGY_KEY}.{role}",
                              allowed=", ".join(sorted({r for r in _roles(topology).values() if r})))
        values = _read_axes(axes, source=source, where=f"{STRATEGY_KEY}.{role}", layer=layer)
        for stage_id in stage_ids:
            layer.stages.setdefault(stage_id, {}).update(values)
    return layer


def _roles(topology: Layer) -> dict[int, str | None]:
    return {sid: canonical_stage(f.get("engine_args.model_arch"), f.get("engine_args.model_stage"))[1]
            for sid, f in topology.stages.items()}


def _stages_of(role: str, topology: Layer) -> list[int]:
    return sorted(sid for sid, stage in _roles(topology).items() if stage == role)


def _read_axes(axes: Any, *, source: str, where: str, layer: Layer) -> dict[str, Any]:
    if not isinstance(axes, list):
        raise ConfigError("must be a list of axis declarations", source=source, field=where, value=axes)
    values: dict[str, Any] = {}
    seen: set[str] = set()
    for index, entry in enumerate(axes):
        at = f"{where}[{index}]"
        if not isinstance(entry, dict) or "axis" not in entry or "size" not in entry:
            raise ConfigError("must be a mapping with `axis` and `size`", source=source, field=at, value=entry)
        if unknown := [k for k in entry if k not in _ENTRY_KEYS]:
            raise unknown_keys(unknown, _ENTRY_KEYS, source=source, section=at)
        axis, size = entry["axis"], entry["size"]
        if axis in seen:
            raise ConfigError(f"axis {axis!r} appears twice", source=source, field=at)
        seen.add(axis)
        if axis in _FIELD_OF:
            values[_FIELD_OF[axis]] = check_field(_FIELD_OF[axis], size, source=source, stage_id=None,
                                                  shown=f"{at}.size")
        elif size != 1:
            reason = _REFUSED.get(axis, "upstream has not implemented it either (reserved)")
            raise ConfigError(f"axis {axis!r} is not supported: {reason}", source=source, field=f"{at}.size",
                              value=size, allowed="1 (off), or the axes tp and stage_replica")
        owner = _OWNER.get(axis)
        if "l1_owner" in entry and entry["l1_owner"] != owner:
            raise ConfigError(f"axis {axis!r} is routed by {owner or 'no one'} here", source=source,
                              field=f"{at}.l1_owner", value=entry["l1_owner"], allowed=repr(owner))
        if "routing" in entry:
            if axis != "stage_replica" or entry["routing"] not in _LB_POLICY:
                raise ConfigError("is a stage_replica axis' policy", source=source, field=f"{at}.routing",
                                  value=entry["routing"], allowed=" | ".join(_LB_POLICY))
            layer.top[LB_POLICY_PATH] = _LB_POLICY[entry["routing"]]
    return values
