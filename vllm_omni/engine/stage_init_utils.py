"""Stage initialization helpers for the multi-stage runtime (spec 002).

Orchestration-level init logic that the engine's launcher shares between the
local, in-process and headless paths: init plans, stage metadata extraction,
device splitting for replicas, device locks, per-stage runtime env, death
signal, process termination, and the normalized per-stage engine args dict.

A helper's stage config argument (spec 002 types it ``Any``: upstream passes
OmegaConf configs) is read once, on entry, into a typed view (``stage_init/
readers.py``): the frozen dataclasses of ``vllm_omni.config`` by their fields,
upstream-shaped mappings and objects by the spec 000 field names. Nothing here
initializes CUDA: stage workers call these before they choose their devices.

The runtime's own start-up uses the device helpers (``replica_pool``,
``stage_worker``: ``split_devices_for_replicas``, ``get_stage_devices_per_replica``,
``stage_runtime_setup``, ``stage_runtime_env``, the device locks) and the process
helpers. The others build upstream's inputs to vLLM (the engine args dict, stage
metadata, init plans, the layout of every stage at once); each module says why our
runtime, which builds from the frozen ``StageConfig``, does not call them.

The helpers live in ``vllm_omni.engine.stage_init`` (plans, readers, metadata,
devices, locks, env, processes, engine_args); this module is their documented
path and re-exports them.

Intentionally absent (upstream builds vLLM objects there; our engine builds its
own config from ``build_engine_args_dict``): ``build_vllm_config``,
``build_stage0_input_processor``, ``build_llm_stage_output_processor``,
``initialize_diffusion_stage``, ``build_diffusion_config``,
``patch_generation_config_if_needed``, ``load_omni_transfer_config_for_model``,
``capture_stage_factory_contexts``.
"""
from __future__ import annotations

import logging

from vllm_omni.engine.stage_init.devices import (
    DEVICE_ENV_VAR,
    compute_replica_layout,
    get_stage_devices_per_replica,
    get_stage_tp_size,
    setup_stage_devices,
    split_devices_for_replicas,
)
from vllm_omni.engine.stage_init.engine_args import (
    AR_WORKER_CLS,
    GENERATION_WORKER_CLS,
    apply_cli_tokenizer,
    build_engine_args_dict,
    get_stage_connector_spec,
    inject_kv_stage_info,
    resolve_worker_cls,
)
from vllm_omni.engine.stage_init.env import stage_runtime_env, stage_runtime_setup
from vllm_omni.engine.stage_init.locks import (
    acquire_device_locks,
    acquire_diffusion_device_locks,
    release_device_locks,
)
from vllm_omni.engine.stage_init.metadata import extract_stage_metadata
from vllm_omni.imports import import_dotted
from vllm_omni.engine.stage_init.plans import (
    LogicalStageInitPlan,
    ReplicaInitPlan,
    StageMetadata,
    StageRemoteFactoryContext,
)
from vllm_omni.engine.stage_init.processes import (
    prepare_engine_environment,
    set_death_signal,
    terminate_alive_proc,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AR_WORKER_CLS",
    "DEVICE_ENV_VAR",
    "GENERATION_WORKER_CLS",
    "LogicalStageInitPlan",
    "ReplicaInitPlan",
    "StageMetadata",
    "StageRemoteFactoryContext",
    "acquire_device_locks",
    "acquire_diffusion_device_locks",
    "apply_cli_tokenizer",
    "build_engine_args_dict",
    "compute_replica_layout",
    "extract_stage_metadata",
    "get_stage_connector_spec",
    "get_stage_devices_per_replica",
    "get_stage_tp_size",
    "import_dotted",
    "inject_kv_stage_info",
    "logger",
    "prepare_engine_environment",
    "release_device_locks",
    "resolve_worker_cls",
    "set_death_signal",
    "setup_stage_devices",
    "split_devices_for_replicas",
    "stage_runtime_env",
    "stage_runtime_setup",
    "terminate_alive_proc",
]
