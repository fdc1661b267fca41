"""An input image as Wan's conditioning (diffusers' WanImageToVideoPipeline.prepare_latents).

I2V-A14B encodes a video whose first frame is the image and whose other frames are zeros, and
gives the transformer a mask (1 on the image's frames) and those latents as extra channels.
TI2V-5B encodes the image alone: its latents replace the first latent frame of the sample, whose
tokens then run at timestep 0 (expand_timesteps). The image is resized to the output size
(diffusers' VideoProcessor); the latents are the VAE posterior's mode, normalized.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.model_executor.models.wan2_2.inputs import ImageCondition


def image_condition(model: Any, image_hw3: torch.Tensor, n: int, frames: int, height: int,
                    width: int) -> ImageCondition:
    """`model`: the WanModel (its VAE on the device); image_hw3: uint8 [H, W, 3]."""
    from PIL import Image

    vae, device, temporal = model.c.vae, model.device, model.temporal
    pixels = model.video_processor.preprocess(Image.fromarray(image_hw3.numpy()), height=height, width=width)
    pixels = pixels.to(device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
    if not model.c.expand_timesteps:
        pixels = torch.cat([pixels, pixels.new_zeros(1, 3, frames - 1, height, width)], dim=2)
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
    latents = latents.repeat(n, 1, 1, 1, 1).to(device, torch.float32)
    mean, std = model.latent_stats(latents)
    latents = (latents - mean) * (1.0 / std)
    h, w = height // model.spatial, width // model.spatial
    if model.c.expand_timesteps:
        mask = torch.ones(1, 1, (frames - 1) // temporal + 1, h, w, dtype=torch.float32, device=device)
        mask[:, :, 0] = 0
        return ImageCondition(latents, mask)
    mask = torch.ones(n, 1, frames, h, w)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2).view(n, -1, temporal, h, w).transpose(1, 2)
    return ImageCondition(torch.cat([mask.to(device), latents], dim=1))
