"""Where the spec 002 helpers' stage configs come in: read once into typed views.

Spec 002 types the helpers' config arguments `Any`: upstream passes OmegaConf configs, which
read both as mappings and as attribute objects, and the spec's worked examples pass dicts and
plain objects. Our own start-up passes the frozen `vllm_omni.config` dataclasses. Each helper
turns its argument into a `StageView` / `RuntimeView` here, on entry: our dataclasses are read by
their typed fields, anything else through `foreign_field` (spec 000 field names) — the only place
below the config edge that reads a config by name. The helpers then read the views' fields.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni.config.stage_config import StageConfig, StageRuntimeConfig, WorkerType


def foreign_field(obj: Any, name: str, default: Any = None) -> Any:
    """`name` of an upstream-shaped config object (a mapping or an attribute object); `default`
    when absent."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass(frozen=True)
class RuntimeView:
    """A stage's `runtime:` as the helpers read it (values as given: the helpers check them)."""

    devices: Any = None  # "0,1", a bare YAML int or a list
    num_replicas: Any = None
    env: Any = None  # a mapping of names to values

    @classmethod
    def of(cls, runtime_cfg: Any) -> RuntimeView:
        if isinstance(runtime_cfg, StageRuntimeConfig):
            return cls(runtime_cfg.devices, runtime_cfg.num_replicas, runtime_cfg.env_dict())
        return cls(*(foreign_field(runtime_cfg, name) for name in ("devices", "num_replicas", "env")))


@dataclass(frozen=True)
class StageView:
    """What the device helpers read of a stage config."""

    stage_id: Any
    stage_type: str  # "llm" or "diffusion"
    tensor_parallel_size: Any
    world_size: Any  # the devices of one diffusion replica (upstream: parallel_config.world_size)
    runtime: RuntimeView

    @classmethod
    def of(cls, stage_cfg: Any, default_id: Any = None) -> StageView:
        if isinstance(stage_cfg, StageConfig):
            ea = stage_cfg.engine_args
            diffusion = ea.worker_type == WorkerType.DIFFUSION
            # Our diffusion stages spread over the devices of their parallel world (CFG x sequence).
            return cls(stage_cfg.stage_id, "diffusion" if diffusion else "llm", ea.tensor_parallel_size,
                       ea.devices_per_replica if diffusion else None,
                       RuntimeView.of(stage_cfg.runtime))
        engine_args = foreign_field(stage_cfg, "engine_args")
        return cls(foreign_field(stage_cfg, "stage_id", default_id), stage_type_of(stage_cfg),
                   foreign_field(engine_args, "tensor_parallel_size"),
                   foreign_field(foreign_field(engine_args, "parallel_config"), "world_size"),
                   RuntimeView.of(foreign_field(stage_cfg, "runtime")))


def as_dict(obj: Any) -> dict[str, Any]:
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


def split_csv(value: Any) -> list[str]:
    """Device lists arrive as "0,1", as a bare YAML int (``devices: 0``) or as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [p.strip() for p in str(value).split(",") if p.strip()]


def positive_int(value: Any, default: int, what: str) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is invalid: must be an integer >= 1") from None
    if n < 1:
        raise ValueError(f"{what}={value!r} is invalid: must be an integer >= 1")
    return n


def stage_type_of(stage_cfg: Any) -> str:
    """An upstream-shaped stage's `stage_type` ("llm" unless given; an enum's value)."""
    stage_type = foreign_field(stage_cfg, "stage_type", None) or "llm"
    return stage_type.value if isinstance(stage_type, enum.Enum) else stage_type
