"""User prompt -> a diffusion stage's input (the text, the negative prompt, an input image), and
the images it returns -> PIL images.

    {"prompt": "a red fox in the snow", "negative_prompt": "blurry"}           # text to image
    {"prompt": "make the sky purple", "multi_modal_data": {"image": <PIL/path/URL/bytes>}}   # edit

Runs in the caller's process like every input processor (input_processors.py), so a bad
image is a ValueError (HTTP 400) before anything is queued. The image travels to the stage as
an HxWx3 uint8 tensor; the negative prompt in `additional_information`. Sizes, steps and
guidance are per-request sampling parameters (`DiffusionSamplingParams`), not prompt keys.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.diffusion_inputs import IMAGE, NEGATIVE_PROMPT
from vllm_omni.multimodal.media import TRUSTED, MediaPolicy, load_image


class DiffusionPromptProcessor:
    def __init__(self, model_name: str = "this model", media: MediaPolicy = TRUSTED) -> None:
        self.model_name = model_name
        self.media = media  # the input image's source and its pixel limit

    def process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        if "prompt" not in prompt or "messages" in prompt or "prompt_token_ids" in prompt:
            raise ValueError(f"{self.model_name} is a diffusion model: give a text prompt "
                             "('a string' or {'prompt': ...}), not token ids or chat messages")
        for key in ("mm_processor_kwargs", "speaker"):
            if prompt.get(key) is not None:
                raise ValueError(f"{self.model_name} takes no {key}")
        info = dict(prompt.get("additional_information") or {})
        negative = prompt.get(NEGATIVE_PROMPT)
        if negative is not None:
            if not isinstance(negative, str):
                raise ValueError(f"negative_prompt must be a string, got {type(negative).__name__}")
            info[NEGATIVE_PROMPT] = negative
        out = OmniTokensPrompt(prompt_token_ids=[], prompt=prompt["prompt"])
        if info:
            out["additional_information"] = info
        media = prompt.get("multi_modal_data")
        if media:
            out["multi_modal_data"] = {IMAGE: self._image(media)}
        return out

    def _image(self, media: Mapping[str, Any]) -> torch.Tensor:
        unknown = sorted(set(media) - {IMAGE})
        if unknown:
            raise ValueError(f"{self.model_name} takes an 'image' as multi_modal_data, not {unknown}")
        source = media[IMAGE]
        if isinstance(source, (list, tuple)):
            if len(source) != 1:
                raise ValueError(f"{self.model_name} edits one image per request, got {len(source)}")
            source = source[0]
        if isinstance(source, torch.Tensor):
            source = source.numpy()
        return torch.from_numpy(np.array(load_image(source, self.media), dtype=np.uint8))


def to_pil_image(image: torch.Tensor) -> Any:
    """One output image, [3, H, W] floats in [0, 1], as a PIL image (diffusers' numpy_to_pil rounding).

        to_pil_image(out.request_output.outputs[0].multimodal_output["image"][0]).save("out.png")
    """
    from PIL import Image

    pixels = (image.detach().float().cpu().permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())
