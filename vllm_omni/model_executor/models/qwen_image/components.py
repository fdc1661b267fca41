"""Loading a Qwen-Image diffusers folder into its components (models/diffusers_folder.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.models.diffusers_folder import component_class, load_component, read_index

EDIT_PIPELINE = "QwenImageEditPipeline"
PIPELINES = ("QwenImagePipeline", EDIT_PIPELINE)


@dataclass
class QwenImageComponents:
    pipeline_class: str
    transformer: Any  # diffusers QwenImageTransformer2DModel
    vae: Any  # diffusers AutoencoderKLQwenImage
    text_encoder: Any  # transformers Qwen2_5_VLForConditionalGeneration (None: not loaded, see load_components)
    tokenizer: Any
    scheduler_config: dict[str, Any]  # FlowMatchEulerDiscreteScheduler's
    image_processor: Any | None  # Qwen2-VL's image processor (edit pipeline)

    @property
    def is_edit(self) -> bool:
        return self.pipeline_class == EDIT_PIPELINE


def load_components(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
                    quantization: Any = None, text_encoder: bool = True,
                    transformer_device: torch.device | None = None) -> QwenImageComponents:
    """`text_encoder=False`: a rank of a parallel stage that never encodes a prompt (rank 0
    prepares every request) leaves out the 7B text encoder. `transformer_device`: where the
    transformer loads (default: `device`; layerwise offload: the CPU)."""
    model_dir = Path(model_dir)
    index = read_index(model_dir, PIPELINES, "Qwen-Image")
    names = ("transformer", "vae", "text_encoder") if text_encoder else ("transformer", "vae")
    where = {"transformer": transformer_device or device, "vae": device, "text_encoder": device}
    models = {name: load_component(model_dir, name, index[name], where[name], dtype, dummy, quantization)
              for name in names}
    tokenizer = component_class(index["tokenizer"]).from_pretrained(model_dir / "tokenizer")
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler_config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler"))
    image_processor = None
    if index["_class_name"] == EDIT_PIPELINE:
        # The PIL flavour of Qwen2-VL's image processor: the default one needs torchvision.
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir / "processor")
    return QwenImageComponents(index["_class_name"], models["transformer"], models["vae"], models.get("text_encoder"),
                               tokenizer, scheduler_config, image_processor)
