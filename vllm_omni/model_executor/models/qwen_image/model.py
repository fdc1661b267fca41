"""`QwenImageModel`: Qwen-Image and Qwen-Image-Edit as a diffusion stage model.

It is a `DiffusionModel` (the diffusion engine's contract, models/diffusion_model.py), made
with diffusers' own components and math, so that a request's image equals the one diffusers'
QwenImagePipeline / QwenImageEditPipeline makes for the same seed, size and steps: the same
prompt encoding, the same seeded noise (a CPU generator, so a seed gives the same image on any
device), the same timestep schedule, the same true-CFG combination, the same VAE decoding.
The engine runs the loop and the flow-matching update (diffusers' Euler step).
"""
from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_omni.model_executor.layers.diffusion_parallel import DiffusionParallelism, gathered, shard_with_hsdp
from vllm_omni.model_executor.models import diffusion_inputs
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention import row_steps, rows_steps
from vllm_omni.model_executor.models.diffusers_folder import set_vae_options
from vllm_omni.model_executor.models.diffusion_model import DiffusionModel
from vllm_omni.model_executor.models.diffusion_offload import OffloadBlocks, visiting
from vllm_omni.model_executor.models.qwen_image import denoiser, vae_decode
from vllm_omni.model_executor.models.qwen_image.block import CompilableBlock
from vllm_omni.model_executor.models.qwen_image.components import QwenImageComponents, load_components
from vllm_omni.model_executor.models.qwen_image.inputs import (Embedded, PromptEmbeds, QwenImageBatch,
                                                                QwenImageRequest)
from vllm_omni.model_executor.models.qwen_image.prompt import PromptEncoder
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest

DEFAULT_SAMPLE_SIZE = 128  # latent pixels: 1024 x 1024 images by default, as the pipeline
EDIT_TARGET_AREA = 1024 * 1024  # the edit pipeline resizes the input image to about this many pixels
ROLES = {"joint": "self"}  # attention roles (models/diffusion_attention.py): one joint attention per block


class QwenImageModel(DiffusionModel):
    def __init__(self, components: QwenImageComponents, *, device: torch.device, cpu_offload: bool = False,
                 acceleration: DenoiserAcceleration = DenoiserAcceleration(),
                 parallel: DiffusionParallelism = DiffusionParallelism(),
                 offload_blocks: OffloadBlocks | None = None) -> None:
        from diffusers.image_processor import VaeImageProcessor

        denoiser.check_supported(components.transformer)
        self.c = components
        self.device = device
        self.acceleration = acceleration
        self.parallel = parallel
        if parallel.sequence is not None:
            parallel.sequence.check_heads(components.transformer.config.num_attention_heads)
        self.compiled = acceleration.compiles(device)
        # Sequence parallelism runs our blocks too (compiled or not): their attention is pluggable.
        self.own_blocks = acceleration.own_blocks(device) or parallel.sequence is not None
        blocks = components.transformer.transformer_blocks
        dtype = components.transformer.dtype
        acceleration.prepare_transformers([blocks], device, dtype)
        # Our blocks: one wrapper per block, compiled all running the same compiled code (regional
        # compilation), each with its attention site (models/diffusion_attention.py).
        self.blocks = blocks
        if self.own_blocks:
            sites = acceleration.attention_sites(ROLES, len(blocks), device, dtype, "Qwen-Image")["joint"]
            compile_fn = acceleration.compile_fn if self.compiled else None
            self.blocks = [CompilableBlock(b, compile_fn, site) for b, site in zip(blocks, sites)]
        if offload_blocks is not None and parallel.hsdp_mesh is not None:  # config refuses it first (diffusion_accel.py)
            raise ValueError("enable_layerwise_offload and use_hsdp: HSDP shards the blocks' weights over the ranks, "
                             "layerwise offload keeps them whole in CPU memory: choose one")
        if parallel.hsdp_mesh is not None:
            shard_with_hsdp(self.blocks, parallel.hsdp_mesh)
        if offload_blocks is not None:
            offload_blocks(self.blocks, device)
            components.transformer.to(device)  # the rest of it; the offloaded blocks' views are there already
        # Offload: the text encoder and the VAE wait on the CPU and visit the device for their calls;
        # the transformer, used every step, stays.
        self.offload = cpu_offload and device.type != "cpu"
        self.vae_scale_factor = 2 ** len(components.vae.temperal_downsample)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.encoder = PromptEncoder(components.text_encoder, components.tokenizer, components.image_processor)
        if self.offload:
            for module in (components.text_encoder, components.vae):  # no text encoder on ranks > 0
                if module is not None:
                    module.to("cpu")

    @classmethod
    def load(cls, model_path: str | Path, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
             vae_use_slicing: bool = False, vae_use_tiling: bool = False, cpu_offload: bool = False,
             acceleration: DenoiserAcceleration = DenoiserAcceleration(), boundary_ratio: float | None = None,
             flow_shift: float | None = None, parallel: DiffusionParallelism = DiffusionParallelism(),
             offload_blocks: OffloadBlocks | None = None) -> QwenImageModel:
        for name, value in (("boundary_ratio", boundary_ratio), ("flow_shift", flow_shift)):
            if value is not None:
                raise ValueError(f"{name}={value}: Qwen-Image has no such setting (video models only: Wan2.2)")
        # Only rank 0 of a parallel stage prepares requests: the others need no text encoder.
        # Offloaded: the transformer loads into CPU memory, and only what is not offloaded moves.
        transformer_device = torch.device("cpu") if offload_blocks is not None else device
        components = load_components(model_path, device=device, dtype=dtype, dummy=dummy,
                                     quantization=acceleration.quantization, text_encoder=parallel.rank == 0,
                                     transformer_device=transformer_device)
        set_vae_options(components.vae, vae_use_slicing, vae_use_tiling)
        return cls(components, device=device, cpu_offload=cpu_offload, acceleration=acceleration, parallel=parallel,
                   offload_blocks=offload_blocks)

    # --- one request -----------------------------------------------------------------------
    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> QwenImageRequest:
        text = diffusion_inputs.prompt_text(request)
        negative = diffusion_inputs.negative_prompt(request)
        image = diffusion_inputs.input_image(request)
        if self.c.is_edit and image is None:
            raise ValueError("Qwen-Image-Edit edits an image: the request has none")
        if not self.c.is_edit and image is not None:
            raise ValueError("Qwen-Image generates images from text; it takes no input image (use Qwen-Image-Edit)")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator("cpu").manual_seed(seed)
        # diffusers' rule: guidance runs with true_cfg_scale > 1 and a negative prompt.
        negative = negative if params.true_cfg_scale > 1 else None
        if self.c.is_edit:
            return self._prepare_edit(text, negative, image, params, generator)
        default = DEFAULT_SAMPLE_SIZE * self.vae_scale_factor
        height, width = params.height or default, params.width or default
        with self._on_device(self.c.text_encoder):
            prompt = self.encoder.encode_text(text, self.device)
            neg = self.encoder.encode_text(negative, self.device) if negative is not None else None
        latents = self._noise(params.num_outputs_per_prompt, height, width, prompt.embeds.dtype, generator)
        self._check_sequence(latents.shape[1])
        sigmas, timesteps = self._schedule(params.num_inference_steps, latents.shape[1])
        shapes = ((1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2),)
        return QwenImageRequest((height, width, None), latents, sigmas, timesteps, prompt, neg, params.true_cfg_scale,
                                height, width, shapes)

    def _prepare_edit(self, text: str, negative: str | None, image_hw3: torch.Tensor,
                      params: DiffusionSamplingParams, generator: torch.Generator) -> QwenImageRequest:
        from diffusers import QwenImagePipeline
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
        from PIL import Image

        image = Image.fromarray(image_hw3.numpy())
        cond_width, cond_height, _ = calculate_dimensions(EDIT_TARGET_AREA, image.size[0] / image.size[1])
        multiple = self.vae_scale_factor * 2
        height = (params.height or cond_height) // multiple * multiple
        width = (params.width or cond_width) // multiple * multiple
        prompt_image = self.image_processor.resize(image, cond_height, cond_width)
        pixels = self.image_processor.preprocess(prompt_image, cond_height, cond_width).unsqueeze(2)
        with self._on_device(self.c.text_encoder):
            prompt = self.encoder.encode_with_image(text, prompt_image, self.device)
            neg = self.encoder.encode_with_image(negative, prompt_image, self.device) if negative is not None else None
        n = params.num_outputs_per_prompt
        image_latents = self._encode_image(pixels.to(self.device, prompt.embeds.dtype)).repeat(n, 1, 1, 1, 1)
        # The VAE's layout is [n, C, 1, h, w]; the pipeline packs it with the sizes it reads off it.
        packed_image = QwenImagePipeline._pack_latents(image_latents, n, image_latents.shape[1],
                                                       *image_latents.shape[3:])
        latents = self._noise(n, height, width, prompt.embeds.dtype, generator)
        self._check_sequence(latents.shape[1] + packed_image.shape[1])
        sigmas, timesteps = self._schedule(params.num_inference_steps, latents.shape[1])
        f = self.vae_scale_factor * 2
        shapes = ((1, height // f, width // f), (1, cond_height // f, cond_width // f))
        self._check_text_positions(shapes, prompt, neg)
        return QwenImageRequest((height, width, (cond_height, cond_width)), latents, sigmas, timesteps, prompt, neg,
                                params.true_cfg_scale, height, width, shapes, image_latents=packed_image)

    def _check_text_positions(self, shapes: tuple[tuple[int, int, int], ...], *prompts: PromptEmbeds | None) -> None:
        """An edit prompt is not truncated (its image's tokens are part of it), and the transformer's
        rotary table has a fixed number of positions, the text's after the image's: a longer prompt
        fails this request with the reason (a 400), not inside a step."""
        rope = self.c.transformer.pos_embed
        first = max(max(h // 2, w // 2) if rope.scale_rope else max(h, w) for _, h, w in shapes)
        most = rope.pos_freqs.shape[0] - first
        longest = max(p.length for p in prompts if p is not None)
        if longest > most:
            raise ValueError(f"the prompt is {longest} text-encoder tokens with its image; this model places at "
                             f"most {most} at this size: shorten the prompt")

    def _check_sequence(self, image_tokens: int) -> None:
        """Sequence parallelism: a length its mode cannot split fails this request (ValueError)."""
        if self.parallel.sequence is not None:
            self.parallel.sequence.check_length(image_tokens)

    def _noise(self, n: int, height: int, width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        from diffusers import QwenImagePipeline
        from diffusers.utils.torch_utils import randn_tensor

        channels = self.c.transformer.config.in_channels // 4
        h = 2 * (height // (self.vae_scale_factor * 2))
        w = 2 * (width // (self.vae_scale_factor * 2))
        noise = randn_tensor((n, 1, channels, h, w), generator=generator, device=self.device, dtype=dtype)
        return QwenImagePipeline._pack_latents(noise, n, channels, h, w)

    def _encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """QwenImageEditPipeline._encode_vae_image: the posterior's mode, normalized."""
        vae = self.c.vae
        with self._on_device(vae):
            latents = vae.encode(pixels.to(vae.device)).latent_dist.mode().to(self.device)
        mean, std = self._latent_stats(latents)
        return (latents - mean) / std

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and std, shaped [1, z, 1, 1, 1] like `like`."""
        config = self.c.vae.config
        return tuple(torch.tensor(values).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
                     for values in (config.latents_mean, config.latents_std))

    def _schedule(self, steps: int, image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's sigmas and timesteps (FlowMatchEulerDiscreteScheduler.set_timesteps with
        the resolution-dependent shift mu), computed for this request alone."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        config = self.c.scheduler_config
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=self.device, mu=mu)
        if not torch.isfinite(scheduler.sigmas).all():  # e.g. one step with shift_terminal: 0 / 0
            raise ValueError(f"num_inference_steps={steps} gives an undefined schedule for this model's scheduler "
                             "(shift_terminal); use 2 or more steps")
        return scheduler.sigmas, scheduler.timesteps

    # --- a denoiser batch ------------------------------------------------------------------
    def make_batch(self, groups: Sequence[Any]) -> QwenImageBatch:
        hidden, embeds, timesteps = [], [], []
        for g in groups:
            p: QwenImageRequest = g.prepared
            hidden.append(g.latents if p.image_latents is None else torch.cat([g.latents, p.image_latents], dim=1))
            prompt: PromptEmbeds = p.negative if g.uncond else p.prompt
            embeds.extend([prompt.embeds[0]] * g.num_rows)
            timesteps.append(g.timestep.expand(g.num_rows).to(g.latents.dtype) / 1000)
        encoder, mask = _pad(embeds)
        first: QwenImageRequest = groups[0].prepared
        rows = sum(g.num_rows for g in groups)
        return QwenImageBatch(torch.cat(hidden), encoder, mask, tuple(e.shape[0] for e in embeds), torch.cat(timesteps),
                              [list(first.img_shapes)] * rows, groups[0].latents.shape[1],
                              tuple(g.step for g in groups for _ in range(g.num_rows)))

    def embed(self, batch: QwenImageBatch) -> Embedded:
        return denoiser.embed(self.c.transformer, batch)

    def modulated_input(self, emb: Embedded) -> torch.Tensor:
        with gathered(self.blocks[0]):  # HSDP: the first block's modulation weights, gathered
            return denoiser.modulated_input(self.c.transformer, emb)

    def block_input(self, emb: Embedded) -> torch.Tensor:
        return emb.hidden

    def run_blocks(self, emb: Embedded, rows: torch.Tensor | None) -> torch.Tensor:
        return self.run_block_range(emb, rows, None, 0, None)[0]

    def num_blocks(self, emb: Embedded) -> int:
        return len(self.blocks)

    def blocks_state(self, emb: Embedded) -> tuple[torch.Tensor, torch.Tensor]:
        return emb.hidden, emb.encoder

    def run_block_range(self, emb: Embedded, rows: torch.Tensor | None, state: tuple[torch.Tensor, torch.Tensor] | None,
                        start: int, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        steps = rows_steps(emb.steps, rows) if self.acceleration.attention.active else None
        kernels = contextlib.nullcontext() if self.own_blocks else self.acceleration.attention_context(self.device)
        with kernels, row_steps(steps):
            return denoiser.run_block_range(self.blocks, emb, rows, self.own_blocks, state, start, end,
                                            self.parallel.sequence)

    def finish(self, emb: Embedded, hidden: torch.Tensor) -> torch.Tensor:
        return denoiser.finish(self.c.transformer, emb, hidden)

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image's true CFG: the guided prediction, rescaled to the conditional one's norm."""
        combined = uncond + scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        noise_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / noise_norm)

    # --- output ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, prepared: Sequence[QwenImageRequest], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Requests finishing in one step share a size (their batch key): one VAE call decodes all."""
        from diffusers import QwenImagePipeline

        vae = self.c.vae
        first = prepared[0]
        packed = QwenImagePipeline._unpack_latents(torch.cat(list(latents)), first.height, first.width,
                                                   self.vae_scale_factor)
        with self._on_device(vae):
            packed = packed.to(vae.device, vae.dtype)
            mean, std = self._latent_stats(packed)
            # The pipeline divides by 1 / std (not the same rounding as multiplying by std).
            images = vae_decode.decode(vae, packed / (1.0 / std) + mean, self.parallel.vae)
        if images is None:  # another rank of a patch-parallel decode: rank 0 has the images
            return []
        images = self.image_processor.postprocess(images[:, :, 0], output_type="pt").float().cpu()
        sizes = [lat.shape[0] for lat in latents]
        return [{"image": part} for part in torch.split(images, sizes)]

    def describe(self) -> dict[str, Any]:
        t = self.c.transformer.config
        return {"pipeline": self.c.pipeline_class, "transformer": type(self.c.transformer).__name__,
                "transformer_layers": t.num_layers,
                "dtype": str(self.c.transformer.dtype).removeprefix("torch."), "cpu_offload": self.offload,
                **self.acceleration.describe(self.device, [self.c.transformer])}

    def _on_device(self, module: Any) -> contextlib.AbstractContextManager[None]:
        return visiting(module, self.device, self.offload)


def _pad(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack [L_i, D] prompt states, zero padded to the longest; the mask is None when no row
    is padded (the pipeline passes no mask for a single prompt, and attention differs with one)."""
    longest = max(e.shape[0] for e in embeds)
    if all(e.shape[0] == longest for e in embeds):
        return torch.stack(embeds), None
    padded = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in embeds])
    mask = torch.stack([torch.cat([torch.ones(e.shape[0], dtype=torch.long), torch.zeros(longest - e.shape[0],
                                                                                           dtype=torch.long)])
                        for e in embeds]).to(padded.device)
    return padded, mask
