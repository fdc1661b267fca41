"""Helpers that make transformers' Qwen2.5-Omni talker behave as the released model was run."""
from __future__ import annotations

import torch


def give_talker_a_mask(module, args, kwargs):
    """Forward pre-hook for `model.talker`: pass an explicit all-ones attention mask.

    transformers 5 drops an all-ones mask, and its talker then skips its prompt handling (see
    tests/models/test_qwen2_5_omni_talker.py); transformers 4 always passed one. The KV cache
    argument is `past_key_values` up to 5.23 and `cache` from 5.24.
    """
    if kwargs.get("attention_mask") is None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        x = kwargs.get("inputs_embeds")
        x = kwargs["input_ids"] if x is None else x
        past = cache.get_seq_length() if cache is not None else 0
        kwargs["attention_mask"] = torch.ones(x.shape[0], past + x.shape[1], dtype=torch.long)
    return args, kwargs
