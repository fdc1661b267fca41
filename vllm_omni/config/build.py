"""Merge validated layers (lowest precedence first) and build the frozen PipelineConfig.

The first layer that lists stages (`defines_topology`) fixes which stages
exist; later layers may only change settings of those stages. Every merged
value remembers the layer it came from so that cross-field and graph errors
still name the right file or flag.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_omni.config import graph, resolve, schema, support
from vllm_omni.config.diffusion_accel import combination_problems
from vllm_omni.config.diffusion_parallel import ParallelConfigError
from vllm_omni.config.errors import ConfigError
from vllm_omni.config.layers import STAGE_STREAMS, Layer
from vllm_omni.config.strategy import LB_POLICY_PATH
from vllm_omni.config.stage_config import (ConfigFormat, IgnoredSetting, PipelineConfig,
                                           PipelineRuntimeConfig, StageConfig, StageEngineArgs,
                                           StageRuntimeConfig, WorkerType)
from vllm_omni.config.stream_options import attach_stream_options
from vllm_omni.config.upstream_keys import IGNORED_PREFIX
from vllm_omni.model_executor.models.families import canonical_stage, diffusion_pipelines
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

DOCUMENTED = "documented default"
_DSP = "default_sampling_params."
_SUBTALKER = "subtalker_sampling_params."


class _Merged:
    """path -> (value, source) for one stage or for the pipeline level."""

    def __init__(self, default_source: str = DOCUMENTED) -> None:
        # An unset field is reported against the file that defines the stage: that is
        # where the user would add it.
        self.default_source = default_source
        self.values: dict[str, tuple[Any, str]] = {}

    def set(self, path: str, value: Any, source: str) -> None:
        self.values[path] = (value, source)

    def has(self, path: str) -> bool:
        return path in self.values

    def get(self, path: str, default: Any = None) -> Any:
        return self.values[path][0] if path in self.values else default

    def source(self, path: str) -> str:
        return self.values[path][1] if path in self.values else self.default_source


def build_pipeline(layers: Sequence[Layer], *, fmt: ConfigFormat, source: str,
                   pipeline_name: str | None = None, default_async_chunk: bool = False,
                   num_devices: int | None = None) -> PipelineConfig:
    """num_devices: the devices this machine shows for the platform; given, every stage's
    runtime.devices must exist (None: not checked, e.g. the CPU or another machine's config)."""
    topo = next((layer for layer in layers if layer.defines_topology), None)
    if topo is None:
        raise ConfigError("no layer defines the pipeline's stages", source=source)
    graph.check_stage_ids(list(topo.stages), source=topo.source)
    stage_ids = sorted(topo.stages)
    merged = {sid: _Merged(topo.source) for sid in stage_ids}
    top = _Merged(source)
    for layer in layers:
        for sid in layer.stages:
            if sid not in merged:
                raise ConfigError(f"the pipeline has no stage {sid}", source=layer.source, stage_id=sid,
                                  field="stage_id", allowed="stage ids " + ", ".join(map(str, stage_ids)))
        for sid in stage_ids:
            for path, value in {**layer.every_stage, **layer.stages.get(sid, {})}.items():
                merged[sid].set(path, value, layer.source)
        for path, value in layer.top.items():
            top.set(path, value, layer.source)

    consumed = {src for m in merged.values() for src in m.get("engine_input_source", ())}
    stages = tuple(build_stage(sid, merged[sid], feeds_another_stage=sid in consumed) for sid in stage_ids)
    for stage in stages:
        if num_devices is not None:
            support.check_devices_exist(stage, num_devices, merged[stage.stage_id].source)

    def source_of(sid: int, path: str) -> str:
        return merged[sid].source(path)

    graph.check_graph(stages, source_of=source_of, source=source)
    for worker_type, settings, kind in ((WorkerType.DIFFUSION, schema.DIFFUSION_FIELDS, ("a", "diffusion")),
                                        (WorkerType.AR, schema.AR_FIELDS, ("an", "AR"))):
        _check_settings_have_a_stage(stages, merged, worker_type, settings, kind)
    _check_diffusion_stages(stages, merged)
    runtime = PipelineRuntimeConfig(enabled=top.get("runtime.enabled", True),
                                    window_size=top.get("runtime.defaults.window_size", -1),
                                    max_inflight=top.get("runtime.defaults.max_inflight", 1))
    connectors = tuple(top.get(p) for p in sorted(top.values) if p.startswith("connectors."))
    edges = graph.resolve_edges(stages, top.get("runtime.edges"), default_window=runtime.window_size,
                                connectors=connectors, edges_source=top.source("runtime.edges"),
                                source_of=source_of)
    stages = attach_stream_options(stages, edges, connectors, source=source)
    # Upstream v0.12 turned streaming on per stage (`async_chunk_stream`); here it is the pipeline's.
    default_async_chunk = default_async_chunk or any(m.get(STAGE_STREAMS, False) for m in merged.values())
    # One stage has no edge to stream over: upstream's thinker-only pipelines run with it off.
    async_chunk = bool(edges) and top.get("async_chunk", default_async_chunk)
    return PipelineConfig(stages=stages, edges=edges, runtime=runtime, connectors=connectors,
                          async_chunk=async_chunk, format=fmt,
                          source=source, pipeline_name=pipeline_name, ignored=_ignored(merged, top),
                          lb_policy=top.get(LB_POLICY_PATH))


# Honoured fields with a value this engine cannot honour (it changes no result): that value is
# ignored with the one warning. step_execution: true is what the diffusion engine always does;
# max_inflight: 1 is spec 000's documented value, which every upstream file writes.
_UNHONOURED_VALUES: dict[str, tuple[Any, str]] = {
    "engine_args.step_execution": (True, "the diffusion engine always runs one denoising step at a time "
                                         "(requests join and abort between steps)"),
    "runtime.defaults.max_inflight": (1, "a stage works on as many requests at once as its batch limit "
                                         "allows (runtime.max_batch_size, or max_num_seqs)"),
}


def _ignored(merged: dict[int, _Merged], top: _Merged) -> tuple[IgnoredSetting, ...]:
    """Every key recorded as ignored, once per (field, reason), with the stages that set it."""
    found: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
    for sid, m in [*merged.items(), (None, top)]:
        for path, (value, source) in m.values.items():
            if path.startswith(IGNORED_PREFIX):  # recorded by a reader, the value is the reason
                field, reason = path[len(IGNORED_PREFIX):], value
            elif path in _UNHONOURED_VALUES and value != _UNHONOURED_VALUES[path][0]:
                field, reason = path, _UNHONOURED_VALUES[path][1]
            else:
                continue
            stages, sources = found.setdefault((field, reason), ([], []))
            if sid is not None:
                stages.append(sid)
            if source not in sources:
                sources.append(source)
    return tuple(IgnoredSetting(field, reason, tuple(stages), ", ".join(sources))
                 for (field, reason), (stages, sources) in found.items())


def build_stage(stage_id: int, m: _Merged, *, feeds_another_stage: bool) -> StageConfig:
    def get(path: str) -> Any:
        return m.get(path, schema.stage_field_default(path))

    # Unset final_output: a sink's output is final, an intermediate stage's is not (schema.py).
    final_output = m.get("final_output", not feeds_another_stage)

    worker_type, worker_cls, scheduler_cls = _worker(stage_id, m)
    runtime = StageRuntimeConfig(process=get("runtime.process"), devices=get("runtime.devices"),
                                 max_batch_size=get("runtime.max_batch_size"),
                                 num_replicas=get("runtime.num_replicas"), env=get("runtime.env"))
    engine_values = {p.split(".", 1)[1]: get(p) for p in schema.STAGE_FIELDS if p.startswith("engine_args.")}
    engine_values.update(worker_type=worker_type, worker_cls=worker_cls, scheduler_cls=scheduler_cls,
                         **_own_stage_names(stage_id, m))
    engine_args = StageEngineArgs(**engine_values)
    _check_diffusion_parallel(stage_id, engine_args, m)
    _check_devices(stage_id, runtime, engine_args, m)
    _check_sleep_mode(stage_id, engine_args, m)
    return StageConfig(
        stage_id=stage_id, runtime=runtime, engine_args=engine_args,
        default_sampling_params=_sampling(stage_id, m, diffusion=worker_type == WorkerType.DIFFUSION),
        engine_input_source=get("engine_input_source"),
        custom_process_input_func=get("custom_process_input_func"),
        is_comprehension=get("is_comprehension"), final_output=final_output,
        final_output_type=get("final_output_type"),
        requires_multimodal_data=get("requires_multimodal_data"),
        input_connectors=_refs(m, "input_connectors."), output_connectors=_refs(m, "output_connectors."),
        max_tokens_limit=get("max_tokens_limit"),
        subtalker_sampling_params=_subtalker(stage_id, m),
        tts_max_instructions_length=get("tts_max_instructions_length"),
    )


def _subtalker(stage_id: int, m: _Merged) -> tuple[tuple[str, Any], ...]:
    """The code predictor's sampling keys as merged from every layer (checked together)."""
    given = {p[len(_SUBTALKER):]: v for p, (v, _) in m.values.items() if p.startswith(_SUBTALKER)}
    if not given:
        return ()
    from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling

    try:
        PredictorSampling.parse(given)
    except (TypeError, ValueError) as exc:
        sources = ", ".join(dict.fromkeys(m.source(p) for p in m.values if p.startswith(_SUBTALKER)))
        raise ConfigError(f"subtalker_sampling_params are inconsistent: {exc}", source=sources,
                          stage_id=stage_id) from None
    return tuple(sorted(given.items()))


def _own_stage_names(stage_id: int, m: _Merged) -> dict[str, str | None]:
    """model_arch / model_stage as our family records name them: upstream's per-stage
    architectures and stage names (`Qwen3TTSCode2Wav`, `qwen3_tts`) are aliases (families.py)."""
    arch, stage = m.get("engine_args.model_arch"), m.get("engine_args.model_stage")
    try:
        arch, stage = canonical_stage(arch, stage)
    except ValueError as exc:
        raise ConfigError(str(exc), source=m.source("engine_args.model_stage"), stage_id=stage_id,
                          field="engine_args.model_stage", value=m.get("engine_args.model_stage")) from None
    return {"model_arch": arch, "model_stage": stage}


def _worker(stage_id: int, m: _Merged) -> tuple[WorkerType, str | None, str | None]:
    """worker_type picks the engine; unset, it follows a documented worker/scheduler class."""
    worker_cls = m.get("engine_args.worker_cls")
    scheduler_cls = m.get("engine_args.scheduler_cls")
    worker_type = m.get("engine_args.worker_type")
    if m.get("stage_type") == "diffusion":  # upstream's spelling; must agree with worker_type
        if worker_type not in (None, WorkerType.DIFFUSION):
            raise ConfigError(f"stage_type 'diffusion' (from {m.source('stage_type')}) contradicts worker_type",
                              source=m.source("engine_args.worker_type"), stage_id=stage_id,
                              field="engine_args.worker_type", value=worker_type.value, allowed="'diffusion'")
        worker_type = WorkerType.DIFFUSION
    elif m.get("stage_type") == "llm" and worker_type == WorkerType.DIFFUSION:
        raise ConfigError("contradicts stage_type 'llm'", source=m.source("engine_args.worker_type"),
                          stage_id=stage_id, field="engine_args.worker_type", value="diffusion",
                          allowed="'ar' or 'generation' for an llm stage")
    if worker_type is None:
        implied = [resolve.WORKER_TYPE_OF[c] for c in (worker_cls, scheduler_cls) if c in resolve.WORKER_TYPE_OF]
        worker_type = implied[0] if implied else WorkerType.AR
    for path, cls in (("engine_args.worker_cls", worker_cls), ("engine_args.scheduler_cls", scheduler_cls)):
        implied_type = resolve.WORKER_TYPE_OF.get(cls)
        if implied_type is not None and implied_type != worker_type:
            raise ConfigError(f"is a {implied_type.value!r} class but the stage's worker_type is "
                              f"{worker_type.value!r} (from {m.source('engine_args.worker_type')})",
                              source=m.source(path), stage_id=stage_id, field=path, value=cls,
                              allowed=f"a class for worker_type {worker_type.value!r}")
    if worker_cls is None:
        worker_cls = resolve.DEFAULT_WORKER_CLS[worker_type]
    if scheduler_cls is None:
        scheduler_cls = resolve.DEFAULT_SCHEDULER_CLS[worker_type]
    return worker_type, worker_cls, scheduler_cls


def _check_diffusion_stages(stages: tuple[StageConfig, ...], merged: dict[int, _Merged]) -> None:
    """A native pipeline class must be one our diffusion engine runs; acceleration settings must agree."""
    if any(s.worker_type == WorkerType.DIFFUSION for s in stages):
        for stage in stages:
            _check_pipeline_class(stage, merged[stage.stage_id])
            _check_acceleration(stage, merged[stage.stage_id])


def _check_settings_have_a_stage(stages: tuple[StageConfig, ...], merged: dict[int, _Merged], worker_type: WorkerType,
                                 settings: dict[str, schema.FieldSpec], kind: tuple[str, str]) -> None:
    """Settings of one kind of stage (CLI flags apply them to every stage) need such a stage to use them."""
    if any(s.worker_type == worker_type for s in stages):
        return
    for stage in stages:
        m = merged[stage.stage_id]
        for name in settings:
            path = f"engine_args.{name}"
            if m.has(path) and m.get(path) != schema.STAGE_FIELDS[path].default:
                raise ConfigError(f"is {kind[0]} {kind[1]} setting and this pipeline has no {kind[1]} stage",
                                  source=m.source(path), stage_id=stage.stage_id, field=path, value=m.get(path))


def _check_acceleration(stage: StageConfig, m: _Merged) -> None:
    """Diffusion settings that contradict each other (config/diffusion_accel.py)."""
    values = {name: getattr(stage.engine_args, name) for name in schema.DIFFUSION_FIELDS}
    for name, problem in combination_problems(values):
        path = f"engine_args.{name}"
        raise ConfigError(problem, source=m.source(path), stage_id=stage.stage_id, field=path, value=m.get(path))


def _check_pipeline_class(stage: StageConfig, m: _Merged) -> None:
    """`model_class_name` of a native (not `diffusers`) diffusion stage names a pipeline registered
    in the family records (families.diffusion_pipelines); a dotted path is a user's own class."""
    name, path = stage.engine_args.model_class_name, "engine_args.model_class_name"
    if name is None or "." in name or stage.engine_args.diffusion_load_format == "diffusers":
        return
    native = diffusion_pipelines()
    if name not in native:
        raise ConfigError(f"{name} is not supported: our diffusion engine has no such pipeline", source=m.source(path),
                          stage_id=stage.stage_id, field=path, value=name,
                          allowed=" | ".join(native) + " (or any diffusers pipeline class with "
                                                       "diffusion_load_format: diffusers)")


def _sampling(stage_id: int, m: _Merged, *, diffusion: bool) -> SamplingParams | DiffusionSamplingParams:
    given = {p[len(_DSP):]: v for p, (v, _) in m.values.items() if p.startswith(_DSP)}
    try:
        if diffusion:  # spec 000's sampling defaults are the text ones; diffusion has its own
            return DiffusionSamplingParams.from_dict(given, where="a diffusion stage's sampling params")
        return SamplingParams.from_dict({**schema.SAMPLING_DEFAULTS, **given})
    except (TypeError, ValueError) as exc:
        # Each value passed on its own when read, so this is a combination (e.g. min_tokens
        # > max_tokens) possibly from different layers: name them all.
        sources = list(dict.fromkeys(m.source(p) for p in m.values if p.startswith(_DSP))) or [m.default_source]
        raise ConfigError(f"default_sampling_params are inconsistent: {exc}", source=", ".join(sources),
                          stage_id=stage_id) from None


def _check_diffusion_parallel(stage_id: int, args: StageEngineArgs, m: _Merged) -> None:
    """The diffusion world (CFG x sequence parallelism x HSDP, VAE patches, num_gpus) can be laid out."""
    try:
        parallel = args.diffusion_parallel.check()
    except ParallelConfigError as exc:
        path = f"engine_args.{exc.field}"
        raise ConfigError(exc.problem, source=m.source(path), stage_id=stage_id, field=path,
                          value=getattr(args, exc.field), allowed=exc.allowed) from None
    if parallel.world_size > 1 and args.diffusion_load_format == "diffusers":
        raise ConfigError(f"a diffusion world of {parallel.world_size} ranks ({parallel.describe_world()}) needs "
                          "our diffusion engine; the diffusers adapter runs a whole pipeline in one process",
                          source=m.source("engine_args.diffusion_load_format"), stage_id=stage_id,
                          field="engine_args.diffusion_load_format", value=args.diffusion_load_format,
                          allowed="'default' or 'dummy'")
    if parallel.vae_patch_parallel_size > 1 and args.vae_use_tiling:
        raise ConfigError("vae_use_tiling and vae_patch_parallel_size > 1 both split the VAE decode; choose one",
                          source=m.source("engine_args.vae_use_tiling"), stage_id=stage_id,
                          field="engine_args.vae_use_tiling", value=True, allowed="false")


def _check_devices(stage_id: int, runtime: StageRuntimeConfig, args: StageEngineArgs, m: _Merged) -> None:
    # One replica uses tensor_parallel_size devices; a replica pool lists them all (spec 002).
    # A diffusion stage runs one rank per device: CFG branches x sequence parallelism (x HSDP replicas).
    n, per_replica, replicas = len(runtime.device_ids), args.devices_per_replica, runtime.num_replicas
    if n == per_replica or n == per_replica * replicas:
        return
    need = f"{per_replica}" + (f" (template) or {per_replica * replicas} (pool of {replicas} replicas)"
                               if replicas > 1 else "")
    raise ConfigError(f"lists {n} device(s) but tensor_parallel_size={args.tensor_parallel_size} "
                      f"(from {m.source('engine_args.tensor_parallel_size')}) x "
                      f"{args.diffusion_parallel.describe_world()} needs {need}",
                      source=m.source("runtime.devices"), stage_id=stage_id, field="runtime.devices",
                      value=runtime.devices, allowed=f"exactly {need} device indices")


def _check_sleep_mode(stage_id: int, args: StageEngineArgs, m: _Merged) -> None:
    """A sleeping stage drops its engine and builds it again in its own process (worker/sleep_mode.py),
    at level 1 from placeholder weights that its CPU copy overwrites."""
    if not args.enable_sleep_mode:
        return
    conflicts = (
        ("tensor_parallel_size", args.tensor_parallel_size != 1, "its other ranks run in other processes"),
        ("cfg_parallel_size", args.cfg_parallel_size != 1, "its second rank runs in another process"),
        *((name, getattr(args, name) != off, "the diffusion stage's other ranks run in other processes")
          for name, off in (("ulysses_degree", 1), ("ring_degree", 1), ("use_hsdp", False),
                            ("vae_patch_parallel_size", 1))),
        ("diffusion_load_format", args.diffusion_load_format == "diffusers",
         "the diffusers adapter has no placeholder weights to wake into"),
        ("enable_layerwise_offload", args.enable_layerwise_offload, "the offloaded blocks live in CPU memory already"),
    )
    for name, conflict, why in conflicts:
        if conflict:
            value = getattr(args, name)
            raise ConfigError(f"does not combine with enable_sleep_mode (from "
                              f"{m.source('engine_args.enable_sleep_mode')}): {why}",
                              source=m.source(f"engine_args.{name}"), stage_id=stage_id,
                              field=f"engine_args.{name}", value=value)


def _refs(m: _Merged, prefix: str) -> tuple[tuple[int, str], ...]:
    return tuple(sorted((int(p[len(prefix):]), v) for p, (v, _) in m.values.items() if p.startswith(prefix)))
