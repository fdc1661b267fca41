"""Init plan and stage metadata dataclasses (spec 002): upstream's records of a stage's start-up.
Our fleet launches from the frozen `StageConfig`s (engine/stage_fleet.py) and keeps no plans."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


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
