"""Frozen, validated stage-pipeline configuration.

These classes are what the rest of the system sees: the loaders in this package
parse YAML / CLI / JSON once into them, and below this edge nobody handles a
raw dict or guesses a default. Everything here is picklable (stage workers are
spawned children), so mappings are stored as tuples of pairs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import msgspec

from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams


class WorkerType(str, Enum):
    """Which engine a stage runs (spec 000 `engine_args.worker_type`)."""

    AR = "ar"
    GENERATION = "generation"
    DIFFUSION = "diffusion"


class EngineOutputType(str, Enum):
    """What a stage's engine emits for the next stage (`engine_args.engine_output_type`)."""

    LATENT = "latent"  # hidden states in addition to token ids
    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    TOKEN_IDS = "token_ids"


class FinalOutputType(str, Enum):
    """What a final stage returns to the user (`final_output_type`)."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"


class ConfigFormat(str, Enum):
    LEGACY = "legacy"  # spec 000 `stage_args`
    DEPLOY = "deploy"  # spec 001 `stages:` overlays on a bundled pipeline
    SINGLE_STAGE = "single_stage"  # plain LLM checkpoint, no config file


@dataclass(frozen=True)
class StageRuntimeConfig:
    """Where and how a stage runs (spec 000 `runtime`, spec 002 replicas/env)."""

    process: bool = True
    devices: str = "0"
    max_batch_size: int = 1
    num_replicas: int = 1
    env: tuple[tuple[str, str], ...] = ()

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.devices.split(","))

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class StageEngineArgs:
    """Engine arguments of one stage. None means "the engine derives it" (e.g.
    max_model_len from the HF config); every other default is the documented one."""

    model_stage: str | None = None
    model_arch: str | None = None
    worker_type: WorkerType = WorkerType.AR
    worker_cls: str | None = None
    scheduler_cls: str | None = None
    gpu_memory_utilization: float = 0.8
    enforce_eager: bool = True
    trust_remote_code: bool = True
    engine_output_type: EngineOutputType = EngineOutputType.LATENT
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    block_size: int | None = None
    tensor_parallel_size: int = 1
    model: str | None = None  # per-stage checkpoint; None = the served model
    tokenizer: str | None = None
    seed: int | None = None
    load_format: str = "auto"
    # Diffusion stages (docs/diffusion.md); JSON objects are stored as tuples of pairs.
    step_execution: bool = False
    diffusion_load_format: str = "default"
    model_class_name: str | None = None
    diffusers_load_kwargs: tuple[tuple[str, Any], ...] = ()
    diffusers_call_kwargs: tuple[tuple[str, Any], ...] = ()
    cache_backend: str = "none"
    cache_config: tuple[tuple[str, Any], ...] | None = None
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    enable_cpu_offload: bool = False
    cfg_parallel_size: int = 1
    ulysses_degree: int = 1
    ulysses_mode: str = "strict"
    ring_degree: int = 1
    vae_patch_parallel_size: int = 1
    use_hsdp: bool = False
    hsdp_shard_size: int = -1
    hsdp_replicate_size: int = 1
    num_gpus: int | None = None  # the diffusion world size, checked against the degrees
    max_generated_image_size: int | None = None
    diffusion_attention_backend: str | None = None  # None: CUDNN_ATTN on CUDA, TORCH_SDPA elsewhere
    diffusion_compile_granularity: str = "regional"
    diffusion_compile_dynamic: bool = True
    boundary_ratio: float | None = None  # None: the checkpoint's (model_index.json)
    flow_shift: float | None = None  # None: the checkpoint's scheduler config
    # Acceleration (config/diffusion_accel.py): typed values from models/diffusion_quantization.py
    # and models/diffusion_attention.py; selectors as sorted indices.
    enable_cache_dit_summary: bool = False
    diffusion_quantization_config: Any = None  # DiffusionQuantization | None
    force_cutlass_fp8: bool = False
    diffusion_kv_cache_dtype: str | None = None  # "fp8"
    diffusion_kv_cache_skip_steps: tuple[int, ...] = ()
    diffusion_kv_cache_skip_layers: tuple[int, ...] = ()
    diffusion_attention_config: Any = None  # DiffusionAttentionConfig | None
    auxiliary_text_encoder: str | None = None
    enable_layerwise_offload: bool = False
    enable_diffusion_pipeline_profiler: bool = False
    # AR stages: per-request queue / prefill / decode durations; checkpoint reading threads
    # (enable_multithread_weight_load false: one).
    enable_ar_profiler: bool = False
    enable_multithread_weight_load: bool = True
    num_weight_load_threads: int = 4
    enable_sleep_mode: bool = False  # POST /sleep frees the stage's device memory

    @property
    def weight_load_threads(self) -> int:
        return self.num_weight_load_threads if self.enable_multithread_weight_load else 1

    @property
    def diffusion_parallel(self) -> DiffusionParallelConfig:
        return DiffusionParallelConfig.from_engine_args(self)

    @property
    def devices_per_replica(self) -> int:
        """Devices one replica of the stage uses: its tensor-parallel ranks x its diffusion world."""
        return self.tensor_parallel_size * self.diffusion_parallel.world_size


@dataclass(frozen=True)
class StageConfig:
    stage_id: int
    runtime: StageRuntimeConfig
    engine_args: StageEngineArgs
    # Mutable (vLLM's shape): take a copy with new_sampling_params() before changing it.
    # Diffusion stages have DiffusionSamplingParams (frozen).
    default_sampling_params: SamplingParams | DiffusionSamplingParams
    engine_input_source: tuple[int, ...] = ()
    custom_process_input_func: str | None = None
    is_comprehension: bool = True
    final_output: bool = True
    final_output_type: FinalOutputType = FinalOutputType.TEXT
    requires_multimodal_data: bool = False
    # (upstream stage id, connector key) / (downstream stage id, connector key)
    input_connectors: tuple[tuple[int, str], ...] = ()
    output_connectors: tuple[tuple[int, str], ...] = ()
    # The most max_tokens a client may ask of this stage (None: no cap but the context, max_model_len).
    max_tokens_limit: int | None = None
    # A talker's code predictor sampling (upstream's subtalker_sampling_params: do_sample,
    # temperature, top_k, top_p as given; model_executor/models/predictor_sampling.py).
    subtalker_sampling_params: tuple[tuple[str, Any], ...] = ()
    tts_max_instructions_length: int | None = None  # a TTS stage's instructions limit (None: the server's)
    # A decoder (generation) stage's chunk options, from the connectors on its input edges
    # (config/stream_options.py): (key as written in the connector's extra, value).
    stream_options: tuple[tuple[str, Any], ...] = ()

    @property
    def batch_limit(self) -> int:
        """The most requests the stage's engine batches: max_num_seqs when given (vLLM's engine
        argument), else runtime.max_batch_size (spec 000)."""
        return self.engine_args.max_num_seqs or self.runtime.max_batch_size

    @property
    def model_stage(self) -> str | None:
        return self.engine_args.model_stage

    @property
    def worker_type(self) -> WorkerType:
        return self.engine_args.worker_type

    def new_sampling_params(self, **changes: Any) -> SamplingParams | DiffusionSamplingParams:
        return self.default_sampling_params.clone(**changes)


@dataclass(frozen=True)
class EdgeConfig:
    """One stage-to-stage edge. window_size -1: the downstream stage starts only
    after the upstream output is complete; N > 0: it is fed every N units."""

    from_stage: int
    to_stage: int
    window_size: int = -1
    connector: str | None = None  # key into PipelineConfig.connectors


@dataclass(frozen=True)
class ConnectorConfig:
    key: str  # the name stages refer to
    name: str  # connector class, e.g. SharedMemoryConnector
    extra: tuple[tuple[str, Any], ...] = ()

    def extra_dict(self) -> dict[str, Any]:
        return dict(self.extra)


@dataclass(frozen=True)
class IgnoredSetting:
    """A key of the config files that has no effect on this engine (config.upstream_keys)."""

    field: str  # as written, e.g. "engine_args.hf_config_name"
    reason: str
    stages: tuple[int, ...] = ()  # empty: a pipeline-level key
    source: str = ""

    def describe(self) -> str:
        where = f" (stage{'s' if len(self.stages) > 1 else ''} {', '.join(map(str, self.stages))})" if self.stages else ""
        return f"{self.field}{where}: {self.reason}"


@dataclass(frozen=True)
class PipelineRuntimeConfig:
    """Top-level `runtime:` of spec 000."""

    enabled: bool = True
    window_size: int = -1  # runtime.defaults.window_size
    max_inflight: int = 1  # runtime.defaults.max_inflight


@dataclass(frozen=True)
class PipelineConfig:
    stages: tuple[StageConfig, ...]  # sorted by stage_id, ids are 0..N-1
    edges: tuple[EdgeConfig, ...]
    runtime: PipelineRuntimeConfig = field(default_factory=PipelineRuntimeConfig)
    connectors: tuple[ConnectorConfig, ...] = ()
    async_chunk: bool = False
    format: ConfigFormat = ConfigFormat.LEGACY
    source: str = ""  # the file(s) or origin it was read from, for messages
    pipeline_name: str | None = None  # bundled pipeline key, when one was used
    ignored: tuple[IgnoredSetting, ...] = ()  # keys read from the files that change nothing here
    # The replica load balancer a strategy file's stage_replica routing asks for (config/strategy.py);
    # None: --omni-lb-policy's.
    lb_policy: str | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(s.stage_id for s in self.stages)

    def stage(self, stage_id: int) -> StageConfig:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(f"pipeline has no stage {stage_id}; stages: {list(self.stage_ids)}")

    @property
    def final_stages(self) -> tuple[StageConfig, ...]:
        return tuple(s for s in self.stages if s.final_output)

    @property
    def entry_stages(self) -> tuple[StageConfig, ...]:
        return tuple(s for s in self.stages if not s.engine_input_source)

    @property
    def comprehension_stage(self) -> StageConfig | None:
        """The first comprehension stage: its tokenizer is the pipeline's default (spec 000)."""
        return next((s for s in self.stages if s.is_comprehension), None)

    def upstream(self, stage_id: int) -> tuple[EdgeConfig, ...]:
        return tuple(e for e in self.edges if e.to_stage == stage_id)

    def downstream(self, stage_id: int) -> tuple[EdgeConfig, ...]:
        return tuple(e for e in self.edges if e.from_stage == stage_id)

    def edge(self, from_stage: int, to_stage: int) -> EdgeConfig:
        for e in self.edges:
            if e.from_stage == from_stage and e.to_stage == to_stage:
                return e
        raise KeyError(f"pipeline has no edge {from_stage} -> {to_stage}")

    def connector(self, key: str) -> ConnectorConfig:
        for c in self.connectors:
            if c.key == key:
                return c
        raise KeyError(f"pipeline has no connector {key!r}")

    def topo_order(self) -> tuple[int, ...]:
        """Stage ids in an order where every stage follows its inputs (ties by id)."""
        done: list[int] = []
        pending = list(self.stage_ids)
        while pending:
            ready = [s for s in pending if all(src in done for src in self.stage(s).engine_input_source)]
            done.append(min(ready))  # the graph was checked acyclic when it was built
            pending.remove(done[-1])
        return tuple(done)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as strings) for JSON output and logs."""
        def clean(obj: Any) -> Any:
            if isinstance(obj, Enum):
                return obj.value
            if isinstance(obj, msgspec.Struct):
                return clean(msgspec.structs.asdict(obj))
            if isinstance(obj, dict):
                return {k: clean(v) for k, v in obj.items() if not str(k).startswith("_")}
            if isinstance(obj, (list, tuple)):
                return [clean(v) for v in obj]
            return obj
        return clean(asdict(self))
