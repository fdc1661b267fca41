"""Tiny random Wan2.2 pipelines, saved in diffusers' own folder layout.

    python -m vllm_omni.testing wan2_2 DIR                 # T2V-A14B layout (the default)
    python -m vllm_omni.testing wan2_2 DIR --layout i2v    # I2V-A14B layout
    python -m vllm_omni.testing wan2_2 DIR --layout ti2v   # TI2V-5B layout

The folder is what `DiffusionPipeline.save_pretrained` writes (model_index.json plus one folder
per component), so diffusers' own `from_pretrained` loads it as the reference. Each layout has
the released model's structure at toy sizes:

- a14b: WanPipeline, `transformer` and `transformer_2` with boundary_ratio 0.875 (the
  high-noise expert runs while timestep >= 875), Wan2.1's VAE (8x spatial, 4x temporal);
- i2v: WanImageToVideoPipeline, the same with boundary_ratio 0.9 and transformers that take
  the image's mask and latents as extra input channels (in_channels = 2 z + 4);
- ti2v: WanPipeline with one transformer, expand_timesteps, and the Wan2.2 VAE (residual
  blocks, 2x2 patchified pixels: 16x spatial), so sizes are multiples of 32.

The scheduler is the released one (UniPC with flow sigmas, flow_shift 3): with 3 or 4 steps
both experts run. Overrides (`--set key=value`) update one component's constructor kwargs by
prefix: `transformer_num_layers=3`, `vae_base_dim=16`, `text_d_model=32`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_omni.testing.config_overrides import prefixed_overrides
from vllm_omni.testing.tokenizer import make_tiny_tokenizer

LAYOUTS = ("a14b", "i2v", "ti2v")
BOUNDARY_RATIO = {"a14b": 0.875, "i2v": 0.9}
# Wan2.2's scheduler_config.json, with a shift that puts the expert switch inside a few steps.
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000,
                 solver_order=2, solver_type="bh2", lower_order_final=True)
# Head dim 12: Wan's RoPE splits it into (frames, height, width) parts of 4.
TRANSFORMER = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2,
                   freq_dim=16, rope_max_seq_len=64)
Z_DIM = 4
# Non-trivial latent statistics exercise the (de)normalization.
VAE = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
           latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0])
# The Wan2.2 VAE: residual up/down blocks over 2x2-patchified pixels (12 channels), a wider decoder.
VAE_2_2 = dict(VAE, decoder_base_dim=12, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
               scale_factor_spatial=16)
TEXT_CONDITIONING_GAIN = 3.0  # see _amplify_text_conditioning
TEXT = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, feed_forward_proj="gated-gelu")


def build_wan2_2(out_dir: Path, overrides: dict[str, Any]) -> None:
    """`overrides["layout"]`: a14b (default), i2v or ti2v; the others are prefixed component kwargs."""
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    overrides = dict(overrides)
    layout = overrides.pop("layout", "a14b")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown wan2_2 layout {layout!r}; known: {LAYOUTS}")
    vae_defaults = VAE_2_2 if layout == "ti2v" else VAE
    parts = prefixed_overrides(overrides, {"transformer_": TRANSFORMER, "vae_": vae_defaults, "text_": TEXT}, "wan2_2")
    tokenizer = make_tiny_tokenizer()
    text = UMT5Config(**parts["text_"], vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), decoder_start_token_id=0)
    # Built in the caller's seeded RNG stream (make_tiny_model seeds it): deterministic per seed.
    text_encoder = UMT5EncoderModel(text).eval()
    vae = AutoencoderKLWan(**parts["vae_"])
    z_dim = parts["vae_"]["z_dim"]
    channels = 2 * z_dim + 4 if layout == "i2v" else z_dim
    experts = 1 if layout == "ti2v" else 2
    transformers = [WanTransformer3DModel(**parts["transformer_"], in_channels=channels, out_channels=z_dim,
                                          text_dim=text.d_model) for _ in range(experts)]
    for transformer in transformers:
        _amplify_text_conditioning(transformer)
    components = dict(transformer=transformers[0], transformer_2=transformers[1] if experts == 2 else None, vae=vae,
                      text_encoder=text_encoder, tokenizer=tokenizer,
                      scheduler=UniPCMultistepScheduler(**SCHEDULER), boundary_ratio=BOUNDARY_RATIO.get(layout))
    if layout == "i2v":
        WanImageToVideoPipeline(**components).save_pretrained(out_dir)
    else:
        WanPipeline(**components, expand_timesteps=layout == "ti2v").save_pretrained(out_dir)


def _amplify_text_conditioning(transformer: Any) -> None:
    """At diffusers' initial scale a tiny transformer barely listens to its prompt: another prompt
    or guidance scale moves the video by ~1e-3, under the 2e-3 that tests compare with diffusers
    at. Three times larger text projection and cross-attention weights move it by ~0.3."""
    import torch

    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if param.ndim >= 2 and (".attn2." in name or "text_embedder" in name):
                param.mul_(TEXT_CONDITIONING_GAIN)


__all__ = ["build_wan2_2", "LAYOUTS"]
