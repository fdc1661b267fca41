"""`GPUDiffusionWorker`: builds a diffusion stage (`stage_type: diffusion`, spec 000 `worker_cls`).

The model comes from the stage's checkpoint, a diffusers pipeline folder: its model_index.json
`_class_name` (or `model_class_name` / `model_arch`) names the family record's stage model,
e.g. QwenImagePipeline -> QwenImageModel, which runs on our DiffusionEngine. With
`diffusion_load_format: diffusers` any diffusers pipeline runs through the adapter instead (one
whole pipeline call per request); `dummy` builds the native model with random weights.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.config.stage_config import StageConfig, StageEngineArgs
from vllm_omni.model_executor.dtypes import canonical_dtype, torch_dtype
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings

# dtype "auto": what the real checkpoints are run in on a GPU; float32 on the CPU (bf16 matmuls there are slow).
_AUTO_CUDA_DTYPE = torch.bfloat16


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if canonical_dtype(dtype) == "auto":
        return _AUTO_CUDA_DTYPE if device.type == "cuda" else torch.float32
    return torch_dtype(dtype)


def load_format(args: StageEngineArgs) -> str:
    """"default" (our engine), "dummy" (our engine, random weights) or "diffusers" (the adapter)."""
    return "dummy" if args.load_format == "dummy" else args.diffusion_load_format


class GPUDiffusionWorker:
    def __init__(self, stage: StageConfig, model: str, *, device: str = "auto") -> None:
        self.stage = stage
        self.model_path = stage.engine_args.model or model
        self.device = torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")

    def build_engine(self) -> Any:
        ea = self.stage.engine_args
        dtype = resolve_dtype(ea.dtype, self.device)
        if load_format(ea) == "diffusers":
            from vllm_omni.diffusion.diffusers_engine import DiffusersPipelineEngine, load_diffusers_pipeline

            pipe = load_diffusers_pipeline(self.model_path, ea, self.device, dtype)
            return DiffusersPipelineEngine(pipe, stage_id=self.stage.stage_id, device=str(self.device),
                                           call_kwargs=dict(ea.diffusers_call_kwargs),
                                           max_image_pixels=ea.max_generated_image_size,
                                           profile=ea.enable_diffusion_pipeline_profiler)
        from vllm_omni.diffusion.engine import DiffusionEngine
        from vllm_omni.diffusion.process_group import DiffusionProcessGroup, ModelSpec, make_cache

        if ea.auxiliary_text_encoder is not None:
            raise ValueError(f"stage {self.stage.stage_id}: auxiliary_text_encoder {ea.auxiliary_text_encoder!r}: the "
                             "native pipelines (Qwen-Image, Wan2.2) take no auxiliary text encoder (upstream's is "
                             "HiDream-I1's Llama encoder; such pipelines run with --diffusion-load-format diffusers)")
        spec = ModelSpec(model_class_path(self.stage, self.model_path), self.model_path, str(dtype).removeprefix("torch."),
                         dummy=load_format(ea) == "dummy", seed=ea.seed or 0, vae_use_slicing=ea.vae_use_slicing,
                         vae_use_tiling=ea.vae_use_tiling, cpu_offload=ea.enable_cpu_offload,
                         acceleration=acceleration(ea), boundary_ratio=ea.boundary_ratio, flow_shift=ea.flow_shift,
                         layerwise_offload=ea.enable_layerwise_offload)
        cache_spec, layout = self._cache_spec(), ea.diffusion_parallel
        if layout.world_size == 1:
            model, group = spec.build(self.device), None
        else:  # the other ranks load their models while this one does
            group = DiffusionProcessGroup.start(spec, cache_spec, self.device, layout)
            try:
                model = spec.build(self.device, group.join())
                group.wait_loaded()
            except BaseException:
                group.close()
                raise
        cache = make_cache(model, cache_spec, group.groups if group else None)
        return DiffusionEngine(model, stage_id=self.stage.stage_id, max_batch_size=self.stage.batch_limit,
                               device=str(self.device), cache=cache, group=group,
                               max_image_pixels=ea.max_generated_image_size,
                               profile=ea.enable_diffusion_pipeline_profiler)

    def _cache_spec(self) -> tuple[str, dict[str, Any], bool] | None:
        """(cache_backend, cache_config, summary) of the stage; None without a cache."""
        ea = self.stage.engine_args
        if ea.cache_backend == "none":
            return None
        return ea.cache_backend, dict(ea.cache_config or ()), ea.enable_cache_dit_summary


def acceleration(args: StageEngineArgs) -> DenoiserAcceleration:
    """The transformer's attention kernel and compilation: compiled unless enforce_eager (CUDA only)."""
    attention = AttentionSettings(args.diffusion_attention_config, args.diffusion_kv_cache_dtype,
                                  args.diffusion_kv_cache_skip_steps, args.diffusion_kv_cache_skip_layers)
    return DenoiserAcceleration(attention_backend=args.diffusion_attention_backend, compile=not args.enforce_eager,
                                compile_dynamic=args.diffusion_compile_dynamic, attention=attention,
                                quantization=args.diffusion_quantization_config,
                                force_cutlass_fp8=args.force_cutlass_fp8)


def model_class_path(stage: StageConfig, model_path: str) -> str:
    """"module:Class" of the native stage model, from the family records."""
    from vllm_omni.config.bundled import model_architecture
    from vllm_omni.model_executor.models.families import FAMILIES

    ea = stage.engine_args
    arch = ea.model_class_name or ea.model_arch or model_architecture(model_path)
    if "." in arch:  # a user's own model class (a plugin)
        return arch
    for family in FAMILIES:
        path = family.model_class_path(arch, ea.model_stage)
        if path is not None:
            return path
    raise ValueError(f"stage {stage.stage_id}: no native diffusion model for pipeline {arch!r}; run it with "
                     "--diffusion-load-format diffusers")
