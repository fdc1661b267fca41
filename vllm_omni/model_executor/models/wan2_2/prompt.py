"""Prompt encoding as diffusers' Wan pipelines do it (`_get_t5_prompt_embeds`), one prompt at a time.

The prompt is cleaned (diffusers' `prompt_clean`: HTML unescaping, ftfy when installed,
whitespace), tokenized to exactly max_sequence_length tokens (512, the pipelines' default) and
encoded by UMT5; the states of the padding positions are replaced by zeros. Every prompt is
therefore [1, 512, text_dim]: prompts of any length batch without a mask.
"""
from __future__ import annotations

from typing import Any

import torch

MAX_SEQUENCE_LENGTH = 512


class PromptEncoder:
    def __init__(self, text_encoder: Any, tokenizer: Any) -> None:
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer

    @torch.inference_mode()
    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizer([prompt_clean(prompt)], padding="max_length", max_length=MAX_SEQUENCE_LENGTH,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        length = int(tokens.attention_mask.gt(0).sum())
        encoder_device = self.text_encoder.device
        states = self.text_encoder(tokens.input_ids.to(encoder_device),
                                   tokens.attention_mask.to(encoder_device)).last_hidden_state
        states = states.to(dtype=self.text_encoder.dtype, device=device)[0, :length]
        return torch.cat([states, states.new_zeros(MAX_SEQUENCE_LENGTH - length, states.shape[1])]).unsqueeze(0)
