"""Tiny random Qwen-Image pipelines, saved in diffusers' own folder layout.

    python -m vllm_omni.testing qwen_image DIR        # QwenImagePipeline (text to image)
    python -m vllm_omni.testing qwen_image_edit DIR   # QwenImageEditPipeline (image editing)

The folder is what `DiffusionPipeline.save_pretrained` writes (model_index.json plus one
folder per component: transformer, vae, text_encoder, tokenizer, scheduler, and for the edit
pipeline processor), so diffusers' own `from_pretrained` loads it as the reference.

Sizes follow notes/offline-models.md ("Tiny diffusion pipeline that runs", with a smaller VAE); the scheduler is
the real Qwen-Image scheduler config (dynamic shifting, shift_terminal), so the tiny model
exercises the real timestep math. Overrides (`--set key=value`) update one component's
constructor kwargs by prefix: `transformer_num_layers=3`, `vae_base_dim=16`, `text_hidden_size=32`
(the text encoder's and the transformer's `joint_attention_dim` follow `text_hidden_size`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_omni.testing.config_overrides import prefixed_overrides
from vllm_omni.testing.tokenizer import QWEN3_OMNI_MM_TOKENS, make_tiny_tokenizer

# Qwen/Qwen-Image's scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}

TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                   num_attention_heads=3, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
# 8x spatial compression like the real VAE (three downsamples), with few channels: the edit
# pipeline encodes its input image at about 1024 x 1024 whatever its size, and the CPU's conv3d
# is slow. Non-trivial latent statistics exercise the (de)normalization.
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
           latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0])
TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]})
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0])
_PREFIXES = {"transformer_": TRANSFORMER, "vae_": VAE, "text_": TEXT, "vision_": VISION}
# The edit pipeline's image processor (Qwen2-VL's, as in Qwen/Qwen-Image-Edit/processor).
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    # max_pixels is the released 12845056 divided by ~200: the text encoder sees ~80 image tokens, not ~1400.
    "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 3136, "max_pixels": 65536,
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}


def build_qwen_image(out_dir: Path, overrides: dict[str, Any]) -> None:
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**_components(overrides)).save_pretrained(out_dir)


def build_qwen_image_edit(out_dir: Path, overrides: dict[str, Any]) -> None:
    """The edit pipeline's processor (Qwen2VLProcessor) cannot be built without torchvision, so
    its folder is written as a released checkpoint has it: the tokenizer files plus the image
    processor's preprocessor_config.json."""
    from diffusers import QwenImagePipeline

    components = _components(overrides)
    # The same components as the text-to-image pipeline, then the edit pipeline's index.
    QwenImagePipeline(**components).save_pretrained(out_dir)
    processor_dir = out_dir / "processor"
    components["tokenizer"].save_pretrained(processor_dir)
    (processor_dir / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    index_path = out_dir / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "QwenImageEditPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def _components(overrides: dict[str, Any]) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    parts = prefixed_overrides(overrides, _PREFIXES, "qwen_image")
    tokenizer = make_tiny_tokenizer(QWEN3_OMNI_MM_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    text = dict(parts["text_"], vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(parts["vision_"], out_hidden_size=text["hidden_size"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    # Built in the caller's seeded RNG stream (make_tiny_model seeds it): deterministic per seed.
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = QwenImageTransformer2DModel(**parts["transformer_"], joint_attention_dim=text["hidden_size"])
    vae = AutoencoderKLQwenImage(**parts["vae_"])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)


__all__ = ["build_qwen_image", "build_qwen_image_edit", "QWEN_IMAGE_SCHEDULER"]
