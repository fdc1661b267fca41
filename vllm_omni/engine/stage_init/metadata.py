"""Stage metadata extraction (spec 002): upstream's lightweight view of a stage config.

Its input is an upstream-shaped config (read with `readers.foreign_field`). Our runtime does not
use it: the orchestrator and the stage workers read the frozen `StageConfig` itself, which holds
these fields typed (and resolves the dotted names once, at start-up)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_omni.engine.stage_init.plans import StageMetadata
from vllm_omni.imports import import_dotted
from vllm_omni.engine.stage_init.readers import foreign_field, stage_type_of


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
    stage_id = foreign_field(stage_config, "stage_id")
    if stage_id is None:
        raise ValueError("stage config has no stage_id")
    stage_type = stage_type_of(stage_config)
    if stage_type not in ("llm", "diffusion"):
        raise ValueError(f"Stage {stage_id}: stage_type={stage_type!r} is invalid: must be 'llm' or 'diffusion'")
    engine_args = foreign_field(stage_config, "engine_args")
    runtime_cfg = foreign_field(stage_config, "runtime")
    requires_mm = foreign_field(stage_config, "requires_multimodal_data", None)
    if requires_mm is None:  # older configs put it under runtime
        requires_mm = foreign_field(runtime_cfg, "requires_multimodal_data", False)
    return StageMetadata(
        stage_id=int(stage_id),
        stage_type=stage_type,
        engine_output_type=foreign_field(engine_args, "engine_output_type"),
        is_comprehension=bool(foreign_field(stage_config, "is_comprehension", False)),
        requires_multimodal_data=bool(requires_mm),
        engine_input_source=[int(s) for s in (foreign_field(stage_config, "engine_input_source") or [])],
        final_output=bool(foreign_field(stage_config, "final_output", False)),
        final_output_type=foreign_field(stage_config, "final_output_type"),
        default_sampling_params=foreign_field(stage_config, "default_sampling_params"),
        custom_process_input_func=_resolve_callable(
            foreign_field(stage_config, "custom_process_input_func"), stage_id, "custom_process_input_func"
        ),
        model_stage=foreign_field(engine_args, "model_stage"),
        runtime_cfg=runtime_cfg,
        prompt_expand_func=_resolve_callable(
            foreign_field(stage_config, "prompt_expand_func"), stage_id, "prompt_expand_func"
        ),
        cfg_kv_collect_func=_resolve_callable(
            foreign_field(stage_config, "cfg_kv_collect_func"), stage_id, "cfg_kv_collect_func"
        ),
    )
