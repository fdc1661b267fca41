"""Qwen-Image (text to image) and Qwen-Image-Edit (image editing): one diffusion stage.

The checkpoint is a diffusers pipeline folder (model_index.json names QwenImagePipeline or
QwenImageEditPipeline); diffusers provides the transformer, VAE and scheduler math,
transformers the Qwen2.5-VL text encoder. `QwenImageModel` serves both pipelines on our
diffusion engine (vllm_omni/diffusion), which runs the denoising loop. `FAMILY` is the
family's registration record (models/family.py); reading it imports nothing heavy.
"""
from __future__ import annotations

from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

_HERE = "vllm_omni.model_executor.models.qwen_image"
_TINY = "vllm_omni.testing.tiny_qwen_image"

FAMILY = ModelFamily(
    name="qwen_image",
    architectures=("QwenImagePipeline", "QwenImageEditPipeline"),
    stage_models={"diffusion": f"{_HERE}.model:QwenImageModel"},
    pipelines={PipelineVariant.DEFAULT: "qwen_image"},
    tiny_checkpoints={"qwen_image": f"{_TINY}:build_qwen_image", "qwen_image_edit": f"{_TINY}:build_qwen_image_edit"},
)
