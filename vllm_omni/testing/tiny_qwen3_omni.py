"""Tiny random Qwen3-Omni-MoE checkpoint (thinker + talker + code2wav), registered as "qwen3_omni_moe".

    make_tiny_model("qwen3_omni_moe", d)                                   # notes' tiny sizes
    make_tiny_model("qwen3_omni_moe", d, thinker_num_hidden_layers=3)      # prefixed shorthand
    make_tiny_model("qwen3_omni_moe", d, talker_config={"accept_hidden_layer": 2})

Overrides are described in tiny_qwen3_omni_config.py. Besides what `make_tiny_model` writes, the
folder gets the Qwen3-Omni tokenizer names (`tokenizer.audio_token` is <|audio_pad|>, ...), the
Qwen3-Omni chat template and preprocessor_config.json (Whisper features + Qwen2-VL images at
patch 16, the released values). Unlike Qwen2.5-Omni there is no speaker file: speakers are
codec ids in the talker config ("ethan", "chelsie").

Running transformers' reference `generate` on it needs two workarounds (transformers 5.23):
`prepare_reference(model)` attaches the thinker's audio config to the talker config (read there
with audio input, never set), and pass `thinker_eos_token_id=` the tokenizer's <|im_end|> id
(the default is the released vocabulary's 151645, outside the tiny one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_omni.multimodal.qwen3_omni_chat_template import QWEN3_OMNI_CHAT_TEMPLATE
from vllm_omni.testing.tiny_models import (
    omni_preprocessor_config,
    perturb_constant_params,
    save_hf_checkpoint,
)
from vllm_omni.testing.tiny_qwen3_omni_config import CODE2WAV_PERTURB_STD, build_config_dict
from vllm_omni.testing.tokenizer import QWEN3_OMNI_MM_TOKENS, make_tiny_tokenizer

# The released checkpoint's preprocessor_config.json: the Qwen2.5-Omni audio settings (300 s
# max, 128 mels at 16 kHz), images at patch 16 normalized with mean = std = 0.5.
PREPROCESSOR_CONFIG = omni_preprocessor_config(
    "Qwen3OmniMoeProcessor",
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    patch_size=16,
)


def use_qwen3_token_names(tokenizer) -> None:
    """Name the Qwen3 placeholder tokens on the (shared-vocabulary) tiny tokenizer; saved with it.

    The tiny tokenizer holds both Omni generations' tokens with the same ids; only which ones
    `tokenizer.audio_token` & co. name differs, and transformers' processor reads those names.
    """
    for attr, token in QWEN3_OMNI_MM_TOKENS.items():
        setattr(tokenizer, attr, token)
        if getattr(tokenizer, attr) != token:  # a transformers version ignoring the assignment
            raise RuntimeError(f"cannot set tokenizer.{attr} to {token}")


def prepare_reference(model) -> None:
    """Work around transformers reading `talker.config.audio_config` (absent) in generate()
    with audio input. Harmless when it is present."""
    talker = getattr(model, "talker", None)
    if talker is not None and getattr(talker.config, "audio_config", None) is None:
        talker.config.audio_config = model.config.thinker_config.audio_config


def _init_talker_experts(talker) -> None:
    # transformers 5.23 leaves the talker's fused MoE experts as torch.empty (its _init_weights
    # covers only the thinker's experts): the checkpoint would hold whatever memory held, not
    # random weights, and change from run to run.
    std = talker.config.text_config.initializer_range
    with torch.no_grad():
        for module in talker.modules():
            if type(module).__name__.endswith("TalkerTextExperts"):
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std)


def build_tiny_qwen3_omni(out_dir: Path, overrides: dict[str, Any]) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = make_tiny_tokenizer()
    # The builder's tokenizer object is what make_tiny_model saves: give it the Qwen3 names
    # and template.
    use_qwen3_token_names(tokenizer)
    tokenizer.chat_template = QWEN3_OMNI_CHAT_TEMPLATE
    cfg = build_config_dict(tokenizer, overrides)
    dtype = cfg.pop("dtype")
    config = Qwen3OmniMoeConfig(**cfg)
    config.dtype = dtype
    model = Qwen3OmniMoeForConditionalGeneration(config)
    perturb_constant_params(model.thinker)
    if config.enable_audio_output:
        _init_talker_experts(model.talker)
        perturb_constant_params(model.talker)
        perturb_constant_params(model.code2wav, std=CODE2WAV_PERTURB_STD)
    model = model.to(getattr(torch, dtype)).eval()
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    save_hf_checkpoint(model, tokenizer, out_dir)
