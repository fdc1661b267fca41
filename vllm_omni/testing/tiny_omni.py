"""Tiny random Qwen2.5-Omni checkpoint (thinker + talker + token2wav), registered as "qwen2_5_omni".

    make_tiny_model("qwen2_5_omni", d)                                    # notes' tiny sizes
    make_tiny_model("qwen2_5_omni", d, thinker_hidden_size=96)            # prefixed shorthand
    make_tiny_model("qwen2_5_omni", d, thinker_config={"text_config": {"num_hidden_layers": 3}})

Overrides are described in tiny_omni_config.py. Besides what `make_tiny_model` writes, the
folder gets the Omni chat template (in the tokenizer files), preprocessor_config.json (Whisper
features + Qwen2-VL images, the released values) and spk_dict.pt (speakers "Chelsie" and
"Ethan"), which `Qwen2_5OmniForConditionalGeneration.from_pretrained` requires. No video config:
like the released folder, video sampling uses qwen-omni-utils' values (vllm_omni.multimodal.video).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_omni.multimodal.chat_template import QWEN2_5_OMNI_CHAT_TEMPLATE
from vllm_omni.testing.tiny_models import (
    omni_preprocessor_config,
    perturb_constant_params,
    save_hf_checkpoint,
)
from vllm_omni.testing.tokenizer import make_tiny_tokenizer
from vllm_omni.testing.tiny_omni_config import (
    BIGVGAN_PERTURB_STD,
    CODEC_EMBED_STD,
    build_config_dict,
)

# Per-speaker text-side bos token (embedded by the thinker's table, like the real spk_dict's
# ids). Any distinct ids work; these tokens are otherwise unused by Qwen2.5-Omni prompts.
SPEAKER_BOS_TOKENS = {"Chelsie": "<tts_text_bos_single>", "Ethan": "<|audio_start|>"}
REF_MEL_FRAMES = 30

# The released checkpoint's preprocessor_config.json (audio: 300 s max, 128 mels at 16 kHz).
PREPROCESSOR_CONFIG = omni_preprocessor_config(
    "Qwen2_5OmniProcessor",
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
    patch_size=14,
)

def _write_speakers(out_dir: Path, tokenizer, dit: dict[str, Any]) -> None:
    # Seeded by the caller's torch seed (make_tiny_model seeds before the builder runs).
    speakers = {
        name: {
            "bos_token": tokenizer.convert_tokens_to_ids(token),
            "cond": torch.randn(1, dit["enc_emb_dim"]),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit["mel_dim"]),
        }
        for name, token in SPEAKER_BOS_TOKENS.items()
    }
    torch.save(speakers, out_dir / "spk_dict.pt")


def build_tiny_qwen2_5_omni(out_dir: Path, overrides: dict[str, Any]) -> None:
    _build(out_dir, overrides)


def build_demo_qwen2_5_omni(out_dir: Path, overrides: dict[str, Any]) -> None:
    """The embedded demo (testing/demo_model.py): the tiny model with a vocoder one can hear,
    its weights shaped to say words and speak them, and its own deploy settings."""
    from vllm_omni.testing import demo_model

    _build(out_dir, {**demo_model.DEMO_BUILD_OVERRIDES, **overrides}, shape=demo_model.shape_demo_weights)
    demo_model.write_demo_deploy(out_dir)


def _build(out_dir: Path, overrides: dict[str, Any], shape=None) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    tokenizer = make_tiny_tokenizer()
    # The builder's tokenizer object is what make_tiny_model saves: give it the Omni template.
    tokenizer.chat_template = QWEN2_5_OMNI_CHAT_TEMPLATE
    cfg = build_config_dict(tokenizer, overrides)
    dtype = cfg.pop("dtype")
    config = Qwen2_5OmniConfig(**cfg)
    config.dtype = dtype
    model = Qwen2_5OmniForConditionalGeneration(config)
    if config.enable_audio_output:
        t2w = model.token2wav
        perturb_constant_params(model.thinker)
        perturb_constant_params(model.talker)
        perturb_constant_params(t2w.code2wav_dit_model)
        perturb_constant_params(t2w.code2wav_bigvgan_model, std=BIGVGAN_PERTURB_STD)
        with torch.no_grad():
            t2w.code2wav_dit_model.text_embed.codec_embed.weight.normal_(0.0, CODEC_EMBED_STD)
    else:
        perturb_constant_params(model)
    if shape is not None:
        shape(model, tokenizer)
    model = model.to(getattr(torch, dtype)).eval()

    _write_speakers(out_dir, tokenizer, cfg["token2wav_config"]["dit_config"])
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    save_hf_checkpoint(model, tokenizer, out_dir)
