"""Typed payloads of the Wan2.2 stage model: one prepared request, one denoiser batch, the
transformer's block inputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ImageCondition:
    """An input image's conditioning, as diffusers' WanImageToVideoPipeline.prepare_latents makes it."""

    latents: torch.Tensor  # float32; I2V-A14B: [n, 4 + z, F, h, w] (mask, then the video's latents);
    #                        TI2V-5B: [n, z, 1, h, w] (the first frame's latents)
    first_frame_mask: torch.Tensor | None = None  # TI2V-5B: [1, 1, F, h, w], 0 on the first latent frame

    def model_input(self, sample: torch.Tensor) -> torch.Tensor:
        """What the transformer sees of a sample [n, z, F, h, w]."""
        if self.first_frame_mask is None:
            return torch.cat([sample, self.latents], dim=1)
        return self._with_first_frame(sample)

    def final(self, sample: torch.Tensor) -> torch.Tensor:
        """The latents to decode: TI2V-5B puts the image's frame back (the solver also moved it)."""
        return sample if self.first_frame_mask is None else self._with_first_frame(sample)

    def _with_first_frame(self, sample: torch.Tensor) -> torch.Tensor:
        return (1 - self.first_frame_mask) * self.latents + self.first_frame_mask * sample


@dataclass(frozen=True)
class WanRequest:
    """A request after `WanModel.prepare`: conditioning, noise and its schedule."""

    batch_key: tuple[int, int, int]  # (frames, height, width): what must match to share a forward
    latents: torch.Tensor  # [n_outputs, z, latent frames, h, w] float32 noise
    timesteps: torch.Tensor  # [steps] on the device
    solver: Any  # models/diffusion_solvers.py: this request's scheduler steps (its state)
    experts: tuple[int, ...]  # per step: 0 = `transformer` (high noise), 1 = `transformer_2`
    cfg_scales: tuple[float, ...]  # per step: guidance_scale, or guidance_scale_2 on the low-noise expert
    prompt: torch.Tensor  # [1, max_sequence_length, text_dim]
    negative: torch.Tensor | None  # set when classifier-free guidance runs
    num_frames: int
    height: int
    width: int
    image: ImageCondition | None = None

    @property
    def do_cfg(self) -> bool:
        return self.negative is not None

    def expert(self, step: int) -> int:
        return self.experts[step]

    def cfg_scale(self, step: int) -> float:
        return self.cfg_scales[step]


@dataclass(frozen=True)
class WanBatch:
    """Rows of one denoiser forward on one expert; tensors only, so it can go to another CFG-parallel rank."""

    hidden_states: torch.Tensor  # [rows, in_channels, F, h, w] in the transformer's dtype
    timestep: torch.Tensor  # [rows], or [rows, tokens] with expand_timesteps (TI2V-5B)
    encoder_hidden_states: torch.Tensor  # [rows, max_sequence_length, text_dim]
    expert: int
    steps: tuple[int, ...] = ()  # each row's denoising step (attention quantization skips steps)


@dataclass
class Embedded:
    """The transformer's block inputs (WanTransformer3DModel.forward's prologue)."""

    hidden: torch.Tensor  # [rows, tokens, dim]
    encoder: torch.Tensor  # [rows, text tokens, dim]
    temb: torch.Tensor  # [rows, dim]; per token or per frame: [rows, T, dim]
    timestep_proj: torch.Tensor  # [rows, 6, dim]; per token or per frame: [rows, T, 6, dim]
    rotary: tuple[torch.Tensor, torch.Tensor]  # diffusers' (cos, sin) tables [1, tokens, 1, head_dim]
    grid: tuple[int, int, int]  # tokens per axis after patching: (frames, height, width)
    expert: int
    steps: tuple[int, ...] = ()
