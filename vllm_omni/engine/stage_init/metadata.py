"""Stage metadata extraction and dotted-path imports (spec 002)."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from vllm_omni.engine.stage_init.plans import StageMetadata
from vllm_omni.engine.stage_init.readers import read_field, stage_type_of


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


def extract_stage_metadata(stage_config: Any) -> StageMetadata:
    """Pure data extraction from a stage config object.

    Documented defaults are the config layer's job; the fallbacks here only
    cover objects that lack a field entirely. ``default_sampling_params`` is
    passed through as the config layer parsed it. Dotted function paths are
    resolved to callables.
    """
    stage_id = read_field(stage_config, "stage_id")
    if stage_id is None:
        raise ValueError("stage config has no stage_id")
    stage_type = stage_type_of(stage_config)
    if stage_type not in ("llm", "diffusion"):
        raise ValueError(f"Stage {stage_id}: stage_type={stage_type!r} is invalid: must be 'llm' or 'diffusion'")
    engine_args = read_field(stage_config, "engine_args")
    runtime_cfg = read_field(stage_config, "runtime")
    requires_mm = read_field(stage_config, "requires_multimodal_data", None)
    if requires_mm is None:  # older configs put it under runtime
        requires_mm = read_field(runtime_cfg, "requires_multimodal_data", False)
    return StageMetadata(
        stage_id=int(stage_id),
        stage_type=stage_type,
        engine_output_type=read_field(engine_args, "engine_output_type"),
        is_comprehension=bool(read_field(stage_config, "is_comprehension", False)),
        requires_multimodal_data=bool(requires_mm),
        engine_input_source=[int(s) for s in (read_field(stage_config, "engine_input_source") or [])],
        final_output=bool(read_field(stage_config, "final_output", False)),
        final_output_type=read_field(stage_config, "final_output_type"),
        default_sampling_params=read_field(stage_config, "default_sampling_params"),
        custom_process_input_func=_resolve_callable(
            read_field(stage_config, "custom_process_input_func"), stage_id, "custom_process_input_func"
        ),
        model_stage=read_field(engine_args, "model_stage"),
        runtime_cfg=runtime_cfg,
        prompt_expand_func=_resolve_callable(
            read_field(stage_config, "prompt_expand_func"), stage_id, "prompt_expand_func"
        ),
        cfg_kv_collect_func=_resolve_callable(
            read_field(stage_config, "cfg_kv_collect_func"), stage_id, "cfg_kv_collect_func"
        ),
    )
