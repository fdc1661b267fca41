"""Dotted names in stage configs: documented defaults, resolution, validation.

Parsing only checks the syntax of a dotted name; nothing is imported then,
because the documented classes pull in torch and the models. Imports happen in
resolve_dotted() (when a stage starts) and validate_dotted_names() (in
`vllm-omni check-config`, or by a launcher that wants every error before any
process starts). A dotted path that is not one of ours is a user plugin: it
is imported the same way, from sys.path.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import PipelineConfig, WorkerType
from vllm_omni.config.stream_options import check_stream_options

AR_WORKER = "vllm_omni.worker.gpu_ar_worker.GPUARWorker"
GENERATION_WORKER = "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"
AR_SCHEDULER = "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler"
GENERATION_SCHEDULER = "vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler"
DIFFUSION_WORKER = "vllm_omni.worker.gpu_diffusion_worker.GPUDiffusionWorker"
DOCUMENTED_SCHEDULERS = (AR_SCHEDULER, GENERATION_SCHEDULER)
_PROCESSORS = "vllm_omni.model_executor.stage_input_processors"

# worker_type -> default worker_cls / scheduler_cls (the diffusion engine schedules its own steps).
DEFAULT_WORKER_CLS = {WorkerType.AR: AR_WORKER, WorkerType.GENERATION: GENERATION_WORKER,
                      WorkerType.DIFFUSION: DIFFUSION_WORKER}
DEFAULT_SCHEDULER_CLS = {WorkerType.AR: AR_SCHEDULER, WorkerType.GENERATION: GENERATION_SCHEDULER,
                         WorkerType.DIFFUSION: None}
# A documented class implies its worker type, so `worker_cls: ...GPUGenerationWorker` alone
# (as upstream's Qwen3-Omni YAML writes it) still selects the generation engine.
WORKER_TYPE_OF = {AR_WORKER: WorkerType.AR, GENERATION_WORKER: WorkerType.GENERATION,
                  AR_SCHEDULER: WorkerType.AR, GENERATION_SCHEDULER: WorkerType.GENERATION,
                  DIFFUSION_WORKER: WorkerType.DIFFUSION}

DOCUMENTED_DOTTED_NAMES = frozenset({
    AR_WORKER, GENERATION_WORKER, AR_SCHEDULER, GENERATION_SCHEDULER, DIFFUSION_WORKER,
    f"{_PROCESSORS}.qwen2_5_omni.thinker2talker", f"{_PROCESSORS}.qwen2_5_omni.talker2code2wav",
    f"{_PROCESSORS}.qwen3_omni.thinker2talker", f"{_PROCESSORS}.qwen3_omni.talker2code2wav",
})

MODEL_REGISTRY_MODULE = "vllm_omni.model_executor.models.registry"

_cache: dict[str, Any] = {}


def resolve_dotted(name: str, *, where: str = "", field: str | None = None) -> Any:
    """Import `package.module.attr` and return the attribute (cached)."""
    if name in _cache:
        return _cache[name]
    module_name, _, attr = name.rpartition(".")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        raise ConfigError(f"cannot import module {module_name!r}: {exc}", source=where or None,
                          field=field, value=name) from None
    if spec is None:
        raise ConfigError(f"module {module_name!r} not found on sys.path", source=where or None,
                          field=field, value=name, allowed="an importable dotted path")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a plugin failing to import is the user's error to see, in full
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}",
                          source=where or None, field=field, value=name) from exc
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}", source=where or None,
                          field=field, value=name, allowed=", ".join(public[:20]) or "(module is empty)")
    _cache[name] = getattr(module, attr)
    return _cache[name]


def supported_architectures() -> frozenset[str]:
    """The model registry's architectures; imported lazily, only when validating."""
    registry = resolve_dotted(f"{MODEL_REGISTRY_MODULE}.supported_architectures",
                              field="model registry")
    return frozenset(registry())


def validate_dotted_names(pipeline: PipelineConfig) -> None:
    """Import every dotted name and check every model_arch; raise one ConfigError listing
    all problems, each naming the stage, the field and the value. Then check that each stage's
    model takes the chunk options of its input connectors (config/stream_options.py)."""
    problems: list[str] = []
    archs: frozenset[str] | None = None
    for stage in pipeline.stages:
        args = stage.engine_args
        names = {"engine_args.worker_cls": args.worker_cls, "engine_args.scheduler_cls": args.scheduler_cls,
                 "custom_process_input_func": stage.custom_process_input_func}
        arch = args.model_arch
        if arch and "." in arch:  # a user's own model class
            names["engine_args.model_arch"] = arch
        elif arch:
            if archs is None:
                try:
                    archs = supported_architectures()
                except ConfigError as exc:
                    problems.append(f"stage {stage.stage_id}: engine_args.model_arch={arch!r}: "
                                    f"cannot check it, the model registry is unavailable ({_what(exc)})")
                    archs = frozenset()
                    continue
            # The registry lists stage models of omni checkpoints as "Arch[model_stage]"; like
            # its resolve_model_class, a plain architecture serves any stage name.
            if archs and arch not in archs and f"{arch}[{args.model_stage}]" not in archs:
                problems.append(f"stage {stage.stage_id}: engine_args.model_arch={arch!r} "
                                f"(model_stage={args.model_stage!r}): not a registered architecture; "
                                f"allowed: {', '.join(sorted(archs))} or a dotted path")
        for field, name in names.items():
            if name is None:
                continue
            try:
                obj = resolve_dotted(name)
            except ConfigError as exc:
                problems.append(f"stage {stage.stage_id}: {field}={name!r}: {_what(exc)}")
                continue
            if not callable(obj):
                problems.append(f"stage {stage.stage_id}: {field}={name!r}: resolves to a "
                                f"{type(obj).__name__}, not a class or function")
    if problems:
        raise ConfigError("dotted names do not resolve:\n  " + "\n  ".join(problems),
                          source=pipeline.source)
    check_stream_options(pipeline)  # the models are importable now: do they take their chunk options?
    _check_predictor_sampling(pipeline)


def _check_predictor_sampling(pipeline: PipelineConfig) -> None:
    """subtalker_sampling_params need a stage model with a code predictor (a talker)."""
    from vllm_omni.model_executor.models.registry import resolve_stage_model_class

    for stage in pipeline.stages:
        arch = stage.engine_args.model_arch
        if not stage.subtalker_sampling_params or arch is None:  # no model_arch: the worker names that problem
            continue
        model_cls = resolve_stage_model_class(arch, stage.model_stage)
        if not getattr(model_cls, "has_code_predictor", False):  # a plugin need not be a StageModel
            raise ConfigError(f"is not supported by {model_cls.__name__} (model_stage "
                              f"{stage.model_stage!r}): it has no code predictor", source=pipeline.source,
                              stage_id=stage.stage_id, field="subtalker_sampling_params",
                              allowed="a talker stage (Qwen3-TTS, Qwen3-Omni)")


def _what(exc: ConfigError) -> str:
    return exc.problem + (f"; allowed: {exc.allowed}" if exc.allowed else "")
