"""Typed payloads of the Qwen-Image stage model: one prepared request, one denoiser batch."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_omni.model_executor.models.diffusion_solvers import FlowEuler


@dataclass(frozen=True)
class PromptEmbeds:
    """One prompt's text-encoder states, as diffusers' `encode_prompt` returns them for one prompt."""

    embeds: torch.Tensor  # [1, L, joint_attention_dim]

    @property
    def length(self) -> int:
        return self.embeds.shape[1]


@dataclass(frozen=True)
class QwenImageRequest:
    """A request after `QwenImageModel.prepare`: conditioning, noise and its schedule."""

    batch_key: tuple  # (height, width, condition image size): what must match to share a forward
    latents: torch.Tensor  # [n_outputs, seq, in_channels] packed noise
    sigmas: torch.Tensor  # [steps + 1] float32
    timesteps: torch.Tensor  # [steps] float32
    prompt: PromptEmbeds
    negative: PromptEmbeds | None  # set when classifier-free guidance runs
    true_cfg_scale: float
    height: int
    width: int
    img_shapes: tuple[tuple[int, int, int], ...]  # RoPE layout: the output (and the edit's input image)
    image_latents: torch.Tensor | None = None  # edit: [n_outputs, cond_seq, in_channels], appended to the sample

    @property
    def do_cfg(self) -> bool:
        return self.negative is not None

    @functools.cached_property
    def solver(self) -> FlowEuler:
        """The pipeline's FlowMatchEulerDiscreteScheduler steps, made once per request (its state)."""
        return FlowEuler(self.sigmas)

    def expert(self, step: int) -> int:
        return 0  # one transformer

    def cfg_scale(self, step: int) -> float:
        return self.true_cfg_scale


@dataclass(frozen=True)
class QwenImageBatch:
    """Rows of one denoiser forward; tensors only, so it can go to another CFG-parallel rank."""

    hidden_states: torch.Tensor  # [rows, seq (+ cond_seq), in_channels]
    encoder_hidden_states: torch.Tensor  # [rows, L, joint_attention_dim], zero padded
    encoder_mask: torch.Tensor | None  # [rows, L] 1 = token, 0 = padding; None: no padding
    text_lengths: tuple[int, ...]  # each row's prompt length (its unpadded part of L)
    timestep: torch.Tensor  # [rows], already / 1000 as the pipeline passes it
    img_shapes: list[list[tuple[int, int, int]]]
    num_latent_tokens: int  # the prediction covers the sample only, not the edit's image tokens
    steps: tuple[int, ...] = ()  # each row's denoising step (attention quantization skips steps)


@dataclass
class Embedded:
    """The transformer's block inputs for one batch (QwenImageTransformer2DModel.forward's prologue)."""

    hidden: torch.Tensor
    encoder: torch.Tensor
    mask: torch.Tensor | None
    text_lengths: tuple[int, ...]
    temb: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]  # complex tables of the image and the (padded) text positions
    num_latent_tokens: int
    steps: tuple[int, ...] = ()
