"""Wan2.2 video generation (T2V-A14B, I2V-A14B, TI2V-5B): one diffusion stage.

The checkpoint is a diffusers pipeline folder (model_index.json names WanPipeline or
WanImageToVideoPipeline); diffusers provides the transformers (`transformer` for high noise and
`transformer_2` for low noise in the A14B models), the VAE and the scheduler math,
transformers the UMT5 text encoder. `WanModel` runs them on our diffusion engine
(vllm_omni/diffusion), which runs the denoising loop. `FAMILY` is the family's registration
record (models/family.py); reading it imports nothing heavy.
"""
from __future__ import annotations

from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

_HERE = "vllm_omni.model_executor.models.wan2_2"

FAMILY = ModelFamily(
    name="wan2_2",
    # diffusers' pipeline classes (a folder's model_index.json `_class_name`), then upstream
    # vLLM-Omni's names of the same pipelines (`--model-class-name`).
    architectures=("WanPipeline", "WanImageToVideoPipeline", "Wan22Pipeline", "Wan22I2VPipeline", "Wan22TI2VPipeline"),
    stage_models={"diffusion": f"{_HERE}.model:WanModel"},
    pipelines={PipelineVariant.DEFAULT: "wan2_2"},
    tiny_checkpoints={"wan2_2": "vllm_omni.testing.tiny_wan2_2:build_wan2_2"},
)
