"""Prompt encoding as diffusers' Qwen-Image pipelines do it, one prompt at a time.

Text to image (QwenImagePipeline._get_qwen_prompt_embeds): the prompt goes into a fixed
system template, the Qwen2.5-VL text encoder runs, its last hidden states are kept without
the template's first 34 tokens, and at most 512 remain. Editing (QwenImageEditPipeline) adds
the input image to the user turn (`<|vision_start|><|image_pad|><|vision_end|>`, the pad
expanded to one token per merged vision patch, as Qwen2VLProcessor does) and drops 64 tokens.

Each prompt is encoded alone, as the pipeline encodes a single prompt: a batch of requests
must give each request exactly its solo result, and padding a text batch would change it.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.model_executor.models.qwen_image.inputs import PromptEmbeds

T2I_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                "<|im_end|>\n<|im_start|>assistant\n")
T2I_DROP = 34
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency "
                 "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_DROP = 64
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default max_sequence_length (text to image only)
IMAGE_TOKEN = "<|image_pad|>"


class PromptEncoder:
    def __init__(self, text_encoder: Any, tokenizer: Any, image_processor: Any | None) -> None:
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.image_processor = image_processor  # Qwen2-VL's, for edits

    @torch.inference_mode()
    def encode_text(self, prompt: str, device: torch.device) -> PromptEmbeds:
        tokens = self.tokenizer([T2I_TEMPLATE.format(prompt)], max_length=TOKENIZER_MAX_LENGTH + T2I_DROP,
                                padding=True, truncation=True, return_tensors="pt").to(device)
        hidden = self._last_hidden(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        return PromptEmbeds(self._embeds(hidden, tokens.attention_mask, T2I_DROP)[:, :MAX_SEQUENCE_LENGTH])

    @torch.inference_mode()
    def encode_with_image(self, prompt: str, image: Any, device: torch.device) -> PromptEmbeds:
        """`image`: the resized PIL image the edit pipeline shows the text encoder."""
        if self.image_processor is None:
            raise ValueError("this checkpoint has no image processor (processor/ folder): it cannot edit images")
        vision = self.image_processor(images=[image], return_tensors="pt")
        num_image_tokens = int(vision["image_grid_thw"][0].prod()) // self.image_processor.merge_size ** 2
        text = EDIT_TEMPLATE.format(prompt).replace(IMAGE_TOKEN, IMAGE_TOKEN * num_image_tokens, 1)
        tokens = self.tokenizer([text], padding=True, return_tensors="pt").to(device)
        hidden = self._last_hidden(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                   pixel_values=vision["pixel_values"].to(device),
                                   image_grid_thw=vision["image_grid_thw"].to(device))
        return PromptEmbeds(self._embeds(hidden, tokens.attention_mask, EDIT_DROP))

    def _last_hidden(self, **inputs: Any) -> torch.Tensor:
        return self.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]

    def _embeds(self, hidden: torch.Tensor, mask: torch.Tensor, drop: int) -> torch.Tensor:
        kept = hidden[0][mask[0].bool()][drop:]  # one prompt: its valid tokens minus the template head
        return kept.unsqueeze(0).to(self.text_encoder.dtype)
