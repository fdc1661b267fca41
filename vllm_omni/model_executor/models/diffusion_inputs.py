"""Where a diffusion stage finds its prompt in a StageRequest (written by the prompt processor,
vllm_omni.multimodal.diffusion_prompt; read by diffusion stage models)."""
from __future__ import annotations

import torch

from vllm_omni.stage_io import StageRequest

NEGATIVE_PROMPT = "negative_prompt"  # additional_information key: str
IMAGE = "image"  # multi_modal_data key: uint8 [H, W, 3], the image to edit


def prompt_text(request: StageRequest) -> str:
    if not isinstance(request.prompt, str):
        raise ValueError("a diffusion request needs a text prompt")
    return request.prompt


def negative_prompt(request: StageRequest) -> str | None:
    value = request.additional_information.get(NEGATIVE_PROMPT)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"negative_prompt must be a string, got {type(value).__name__}")
    return value


def input_image(request: StageRequest) -> torch.Tensor | None:
    image = (request.multi_modal_data or {}).get(IMAGE)
    if image is None:
        return None
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3:
        raise ValueError("the input image must be an HxWx3 uint8 tensor")
    return image
