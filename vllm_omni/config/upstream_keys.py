"""Keys that upstream vLLM-Omni configs carry and our schema does not implement, and what each
does here. Every key is in exactly one table; docs/compatibility.md prints them.

- IGNORED: no effect on this engine's results; the file loads and one warning per load names
  every ignored key (`PipelineConfig.ignored`, `vllm-omni check-config` prints them).
- REFUSED: would change what the engine computes and is not implemented: an error naming the
  key and the reason, unless the value is one that describes what this engine does anyway
  (`tensor_parallel_size`-style "no-op" values such as `quantization: null`,
  `pipeline_parallel_size: 1`): such a value is accepted silently.
- UNSUPPORTED_FEATURES: keys that belong to a feature this build does not have (diffusion,
  full duplex, TTS, prefill/decode disaggregation, pooling): "<key> is not supported: ...".

Honoured keys are schema.STAGE_FIELDS (and the deploy/legacy top-level keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.schema import DIFFUSION_FIELDS

# Readers record an ignored key as {"ignored.<field as written>": reason}; build.py gathers them
# into PipelineConfig.ignored and the loader logs them in one warning.
IGNORED_PREFIX = "ignored."


@dataclass(frozen=True)
class Refusal:
    reason: str
    # Values that mean "the feature is off": accepted (this engine does exactly that).
    neutral: tuple[Any, ...] = ()


PER_STAGE_STREAMING = ("streaming between stages is set for the whole pipeline (top-level async_chunk, "
                       "--async-chunk) and runs where a family has a stream bridge")
PER_FAMILY_STREAMING = "a streaming edge cuts and hands over chunks with the model family's stream bridges"

# vLLM / upstream engine args with no effect here (by key in engine_args, flat deploy stage
# entries and the deploy file's top level).
IGNORED_ENGINE_ARGS: dict[str, str] = {
    "distributed_executor_backend": "stage workers are always separate processes here",
    "async_scheduling": "AR stages schedule asynchronously wherever the model allows "
                        "(VLLM_OMNI_ASYNC_SCHEDULING=0 turns it off)",
    "mm_processor_cache_gb": "there is no multimodal processor cache",
    "skip_mm_profiling": "the KV cache is sized without a multimodal profiling run",
    "enable_flashinfer_autotune": "flashinfer is not used",
    "max_cudagraph_capture_size": "CUDA graph batch sizes are chosen by the engine (enforce_eager turns them off)",
    "compilation_config": "there is no torch.compile step; CUDA graphs follow enforce_eager",
    "disable_hybrid_kv_cache_manager": "the KV cache has one layout",
    "hf_config_name": "each stage model reads its own part of the checkpoint's config, chosen by model_stage",
    "custom_process_next_stage_input_func": "streaming edges use the model family's stream bridges",
    "max_batch_size": "not an engine argument; a stage's batch size is runtime.max_batch_size or max_num_seqs",
    "profiler_config": "the torch profiler hooks of upstream are not implemented",
    "model_runner": "this engine has one model runner",
}

REFUSED_ENGINE_ARGS: dict[str, Refusal] = {
    "quantization": Refusal("quantized checkpoints are not supported", (None,)),
    "kv_cache_dtype": Refusal("the KV cache uses the model dtype", (None, "auto")),
    "pipeline_parallel_size": Refusal("pipeline parallelism is not supported", (None, 1)),
    "data_parallel_size": Refusal("use runtime.num_replicas (or --omni-dp-size-local) for replicas", (None, 1)),
    "enable_expert_parallel": Refusal("expert parallelism is not supported", (None, False)),
    "speculative_config": Refusal("speculative decoding is not supported", (None,)),
    "enable_lora": Refusal("LoRA adapters are not supported", (None, False)),
    "hf_overrides": Refusal("the checkpoint's config.json is used as it is", (None, {})),
    "tokenizer_mode": Refusal("only Hugging Face tokenizers are supported", (None, "auto", "hf")),
    "config_format": Refusal("only Hugging Face config.json checkpoints are supported", (None, "auto", "hf")),
}

_DIFFUSION = "our diffusion engine does not implement it (docs/diffusion.md lists what it does)"
_DUPLEX = "full-duplex sessions are not supported (requests are turn based)"
_TTS = "our Qwen3-TTS stages do not implement it (docs/tts.md)"
_PD = "prefill/decode disaggregation (KV transfer between stages) is not supported"
# Upstream's word timestamps for TTS: a Qwen3-ForcedAligner pooling model beside the pipeline.
FORCED_ALIGNER = "forced_aligner"
FORCED_ALIGNER_REASON = "word timestamps with a forced aligner (Qwen3-ForcedAligner) are not supported"

# Keys of upstream's diffusion stages (its StageDeployConfig diffusion fields).
DIFFUSION_KEYS = frozenset({
    "ulysses_degree", "ulysses_mode", "ulysses_a2a_permute", "ring_degree", "allgather_degree",
    "context_parallel_degree", "sequence_parallel_size", "cfg_parallel_size", "vae_patch_parallel_size",
    "vae_parallel_mode", "text_encoder_tp_size", "use_hsdp", "hsdp_shard_size", "hsdp_replicate_size",
    "model_class_name", "diffusion_load_format", "lora_path", "lora_backend", "lora_scale",
    "diffusers_load_kwargs", "diffusers_call_kwargs", "diffusion_quantization_config",
    "diffusion_attention_backend", "diffusion_attention_config", "diffusion_compile_granularity",
    "diffusion_compile_dynamic", "cache_backend", "cache_config", "enable_cache_dit_summary", "step_execution",
    "vae_use_slicing", "vae_use_tiling", "boundary_ratio", "flow_shift", "diffusion_kv_cache_dtype",
    "diffusion_kv_cache_skip_steps", "diffusion_kv_cache_skip_layers", "auxiliary_text_encoder",
    "enable_cpu_offload", "enable_layerwise_offload", "diffusion_offload_config", "max_generated_image_size",
    "enable_diffusion_pipeline_profiler", "parallel_config",
})

# Upstream's other sequence-parallel variants and options: accepted when they are off.
_DIFFUSION_OFF: dict[str, tuple[Any, ...]] = {
    "allgather_degree": (1,), "context_parallel_degree": (1,), "sequence_parallel_size": (None, 1),
    "ulysses_a2a_permute": (False,), "text_encoder_tp_size": (1,),
    # Our patch-parallel decode splits the latent's rows (height) with a halo.
    "vae_parallel_mode": ("spatial_shard_height",),
}

UNSUPPORTED_FEATURES: dict[str, Refusal] = {
    # Those our diffusion engine implements are its stage fields (config/schema.DIFFUSION_FIELDS);
    # parallel_config is read into them (config/upstream_parallel.py).
    **{key: Refusal(_DIFFUSION, _DIFFUSION_OFF.get(key, ()))
       for key in DIFFUSION_KEYS - set(DIFFUSION_FIELDS) - {"parallel_config"}},
    "kv_transfer_config": Refusal(_PD, (None,)),
    "is_prefill_only": Refusal(_PD, (False,)),
    "is_decode_only": Refusal(_PD, (False,)),
    "session_mode": Refusal(_DUPLEX, ("turn",)),
    "duplex_session": Refusal(_DUPLEX, (None,)),
    "active_stream_window": Refusal(_DUPLEX, (0,)),
    "custom_voice_dir": Refusal(_TTS, (None,)),
    "silence_ban_frames": Refusal(_TTS, (0,)),
    "default_pooling_params": Refusal("pooling models are not supported", (None,)),
    FORCED_ALIGNER: Refusal(FORCED_ALIGNER_REASON, (None,)),
}

def is_policy_key(key: str) -> bool:
    """A key one of the tables above decides about."""
    return key in IGNORED_ENGINE_ARGS or key in REFUSED_ENGINE_ARGS or key in UNSUPPORTED_FEATURES


def apply_policy(key: str, value: Any, *, source: str, stage_id: int | None, field: str) -> str | None:
    """The reason a key is ignored (to warn about), None when it is accepted silently;
    ConfigError when it is refused."""
    if key in IGNORED_ENGINE_ARGS:
        return IGNORED_ENGINE_ARGS[key]
    refusal = REFUSED_ENGINE_ARGS.get(key)
    if refusal is not None:
        if _neutral(value, refusal):
            return None
        raise ConfigError(f"is a vLLM engine argument that this engine does not implement: {refusal.reason}",
                          source=source, stage_id=stage_id, field=field, value=value,
                          allowed=_allowed(refusal))
    refusal = UNSUPPORTED_FEATURES[key]
    if _neutral(value, refusal):
        return None
    raise ConfigError(f"{key} is not supported: {refusal.reason}", source=source, stage_id=stage_id,
                      field=field, value=value, allowed=_allowed(refusal))


def _neutral(value: Any, refusal: Refusal) -> bool:
    return any(value == v and type(value) is type(v) for v in refusal.neutral)


def _allowed(refusal: Refusal) -> str | None:
    shown = [repr(v) if v is not None else "null" for v in refusal.neutral]
    return " or ".join(shown) + " (off)" if shown else None
