"""`GPUGenerationWorker`: builds a non-autoregressive stage (spec 000 `worker_cls`), e.g. code2wav.

The model class comes from `engine_args.model_arch`: a name in the model registry
(looked up with the stage's `model_stage`) or a dotted path to a user's class. It must
subclass `model_executor.models.generation_model.GenerationModel`.
"""
from __future__ import annotations

from vllm_omni.config.stage_config import StageConfig
from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.model_executor.models.registry import resolve_generation_model_class
from vllm_omni.worker.generation_stage_engine import GenerationStageEngine


def generation_model_class(stage: StageConfig) -> type[GenerationModel]:
    arch = stage.engine_args.model_arch
    if arch is None:
        raise ValueError(f"stage {stage.stage_id}: a generation stage needs engine_args.model_arch")
    return resolve_generation_model_class(arch, stage.engine_args.model_stage)


class GPUGenerationWorker:
    def __init__(self, stage: StageConfig, model: str, *, device: str = "auto") -> None:
        self.stage = stage
        self.model = model
        self.device = device

    def build_engine(self) -> GenerationStageEngine:
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        ea = self.stage.engine_args
        if ea.tensor_parallel_size != 1:
            raise ValueError(f"stage {self.stage.stage_id}: tensor_parallel_size={ea.tensor_parallel_size} is "
                             "supported by AR stages only (worker_type: ar)")
        model_cls = generation_model_class(self.stage)
        # The chunk settings of the connector on its input edge (docs/streaming.md), for a model
        # that declares it takes them; the config has checked that it does.
        stream = ({"stream_config": model_cls.stream_config(dict(self.stage.stream_options))}
                  if self.stage.stream_options else {})
        # CUDA graphs (enforce_eager false), for a model that declares it has them.
        graphs = {"cuda_graphs": not ea.enforce_eager} if model_cls.supports_cuda_graphs else {}
        model = model_cls.load(ea.model or self.model, model_stage=ea.model_stage, device=torch.device(device),
                               dtype=ea.dtype, load_format=ea.load_format, **stream, **graphs)
        return GenerationStageEngine(model, OmniGenerationScheduler(self.stage.batch_limit),
                                     stage_id=self.stage.stage_id, device=device)
