"""Duck-typed readers of stage configs (spec 000 field names) shared by the stage init helpers.

Callers pass both the frozen dataclasses of ``vllm_omni.config`` and plain
dicts/objects (tests, headless registration), so fields are read by name from
either.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any


def read_field(obj: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a mapping or an object; ``default`` when absent."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


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
    stage_type = read_field(stage_cfg, "stage_type", None) or "llm"
    return getattr(stage_type, "value", stage_type)  # the config layer may use an enum
