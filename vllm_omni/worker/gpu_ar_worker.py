"""`GPUARWorker`: builds the autoregressive engine of one stage (spec 000 `worker_cls`).

The name is the documented one; it runs on CPU too. The stage worker process calls
`build_engine()` once; everything device-related happens inside it, after the
process has applied the stage's visible devices.
"""
from __future__ import annotations

from typing import Any

from vllm_omni.config.stage_config import EngineOutputType, StageConfig
from vllm_omni.worker.ar_stage_engine import ARStageEngine


def engine_config_kwargs(stage: StageConfig, model: str, device: str) -> dict[str, Any]:
    """EngineConfig arguments for a stage; unset (None) stage fields keep the engine's defaults."""
    ea = stage.engine_args
    kwargs: dict[str, Any] = dict(
        model=ea.model or model,
        tokenizer=ea.tokenizer,
        dtype=ea.dtype,
        device=device,
        max_num_seqs=stage.batch_limit,
        enable_prefix_caching=ea.enable_prefix_caching,
        gpu_memory_utilization=ea.gpu_memory_utilization,
        enforce_eager=ea.enforce_eager,
        architecture=ea.model_arch,
        model_stage=ea.model_stage,
        load_format=ea.load_format,
        tensor_parallel_size=ea.tensor_parallel_size,
        num_weight_load_threads=ea.weight_load_threads,
        predictor_sampling=stage.subtalker_sampling_params,
    )
    optional = dict(seed=ea.seed, max_model_len=ea.max_model_len, block_size=ea.block_size,
                    max_num_batched_tokens=ea.max_num_batched_tokens, enable_chunked_prefill=ea.enable_chunked_prefill)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


class GPUARWorker:
    def __init__(self, stage: StageConfig, model: str, *, device: str = "auto") -> None:
        self.stage = stage
        self.model = model
        self.device = device

    def build_engine(self) -> ARStageEngine:
        from vllm_omni.core.engine_config import EngineConfig
        from vllm_omni.core.llm_engine import LLMEngine

        kwargs = engine_config_kwargs(self.stage, self.model, self.device)
        layers = None
        if self.stage.engine_args.engine_output_type == EngineOutputType.LATENT:
            layers = exported_hidden_state_layers(kwargs["model"], self.stage)
            kwargs["hidden_state_layers"] = layers or ()
        return ARStageEngine(LLMEngine(EngineConfig(**kwargs)), stage_id=self.stage.stage_id,
                             export_hidden_states=layers is not None,
                             profile=self.stage.engine_args.enable_ar_profiler)


def exported_hidden_state_layers(model: str, stage: StageConfig) -> tuple[int, ...] | None:
    """The layers a latent stage exports besides LAST, or None when its model exports no hidden
    states at all (StageModel.exports_hidden_states / exported_hidden_states; some layers depend
    on the checkpoint's config)."""
    from vllm_omni.model_executor.model_loader import load_hf_config
    from vllm_omni.model_executor.models.registry import resolve_model_class

    config = load_hf_config(model)
    arch = stage.engine_args.model_arch or (config.architectures or [None])[0]
    if arch is None:
        raise ValueError(f"stage {stage.stage_id}: the config of {model} names no architecture; "
                         "set engine_args.model_arch")
    model_cls = resolve_model_class(arch, stage.engine_args.model_stage)
    return tuple(model_cls.exported_hidden_states(config)) if model_cls.exports_hidden_states else None
