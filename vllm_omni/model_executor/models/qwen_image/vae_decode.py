"""Qwen-Image's VAE decode, optionally split into bands of latent rows across ranks.

AutoencoderKLQwenImage decodes one frame as post_quant_conv -> decoder (conv_in, a mid block
with spatial self-attention, up blocks of 3x3 convolutions and nearest-neighbour upsampling,
norm, conv_out) -> clamp. Everything after the mid block is local, so it splits into bands of
rows: every rank runs the global head (conv_in and the mid block, whose attention sees the whole
latent; cheap at latent resolution) and the rest on its band plus a halo of rows as deep as the
up path's receptive field (`decoder_halo`); rank 0 gathers the bands (layers/diffusion_parallel).
For a single frame the decoder's causal time cache is empty, so calling its modules without it
runs the same math as diffusers' `_decode`.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from vllm_omni.model_executor.layers.diffusion_parallel import PatchGroup, decode_row_bands


def decode(vae: Any, z: torch.Tensor, patch: PatchGroup | None) -> torch.Tensor | None:
    """Pixels in [-1, 1] of latents z [B, C, 1, h, w] (as vae.decode takes them); with `patch`,
    rank 0 returns them and the other ranks of the patch group None."""
    if patch is None:
        return vae.decode(z, return_dict=False)[0]
    decoder = vae.decoder
    halo, scale = decoder_halo(decoder), 2 ** _upsamplings(decoder)
    parts = []
    for part in (z.split(1) if vae.use_slicing else (z,)):  # slicing: one image at a time, as diffusers
        head = decoder.mid_block(decoder.conv_in(vae.post_quant_conv(part)))
        parts.append(decode_row_bands(patch, head, halo=halo, scale=scale, decode=lambda band: _tail(decoder, band)))
    return None if parts[0] is None else torch.cat(parts).clamp(-1.0, 1.0)


def decoder_halo(decoder: Any) -> int:
    """Latent rows beyond its own that a band needs for exact output rows: the receptive field of
    the up path (two 3x3 convolutions per residual block, 2x nearest upsampling followed by a 3x3
    convolution, conv_out), followed in output pixels and divided back to latent rows."""
    depth = 0
    for up_block in decoder.up_blocks:
        depth += 2 * len(up_block.resnets)
        if up_block.upsamplers is not None:
            depth = 2 * depth + 1
    depth += 1  # conv_out
    return math.ceil(depth / 2 ** _upsamplings(decoder))


def _tail(decoder: Any, x: torch.Tensor) -> torch.Tensor:
    for up_block in decoder.up_blocks:
        x = up_block(x)
    return decoder.conv_out(decoder.nonlinearity(decoder.norm_out(x)))


def _upsamplings(decoder: Any) -> int:
    return sum(up_block.upsamplers is not None for up_block in decoder.up_blocks)
