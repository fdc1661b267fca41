"""`WanModel`: Wan2.2 (T2V-A14B, I2V-A14B, TI2V-5B) as a diffusion stage model.

It implements the model side of the diffusion engine's contract (models/diffusion_model.py)
with diffusers' own components and math, so that a request's video equals the one diffusers'
WanPipeline / WanImageToVideoPipeline makes for the same seed, size, frames and steps: the
same prompt encoding, seeded noise (a CPU generator: a seed gives the same video on any
device), schedule (the folder's scheduler, UniPC for the released models), expert switch
(`transformer` while timestep >= boundary_ratio * num_train_timesteps, then `transformer_2`,
each with its own guidance scale), image conditioning and VAE decoding. The engine runs the
loop; each request's solver (models/diffusion_solvers.py) does the scheduler's update.
"""
from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.layers.diffusion_parallel import DiffusionParallelism, shard_with_hsdp
from vllm_omni.model_executor.models import diffusion_inputs
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention import row_steps, rows_steps
from vllm_omni.model_executor.models.diffusers_folder import set_vae_options
from vllm_omni.model_executor.models.diffusion_model import DiffusionModel
from vllm_omni.model_executor.models.diffusion_offload import Experts, OffloadBlocks, visiting
from vllm_omni.model_executor.models.diffusion_solvers import solver_for
from vllm_omni.model_executor.models.wan2_2 import denoiser
from vllm_omni.model_executor.models.wan2_2.block import CompilableWanBlock
from vllm_omni.model_executor.models.wan2_2.components import WanComponents, load_components
from vllm_omni.model_executor.models.wan2_2.conditioning import image_condition
from vllm_omni.model_executor.models.wan2_2.inputs import Embedded, WanBatch, WanRequest
from vllm_omni.model_executor.models.wan2_2.prompt import PromptEncoder
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest, VideoInfo

# diffusers' WanPipeline / WanImageToVideoPipeline call defaults.
DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES, DEFAULT_GUIDANCE_SCALE = 480, 832, 81, 5.0
# Wan2.2's sample_fps (its own configs; diffusers' folders do not say): A14B 16, TI2V-5B 24.
FPS_A14B, FPS_TI2V = 16, 24
ROLES = {"self": "self", "cross": "cross"}  # attention roles (models/diffusion_attention.py) of each block


class WanModel(DiffusionModel):
    def __init__(self, components: WanComponents, *, device: torch.device, cpu_offload: bool = False,
                 acceleration: DenoiserAcceleration = DenoiserAcceleration(),
                 parallel: DiffusionParallelism = DiffusionParallelism(),
                 offload_blocks: OffloadBlocks | None = None) -> None:
        from diffusers.video_processor import VideoProcessor

        self.c = components
        self.device = device
        self.acceleration = acceleration
        self.parallel = parallel
        self.compiled = acceleration.compiles(device)
        # Offload: the text encoder, the VAE and the expert not in use wait on the CPU (with layerwise
        # offload the experts' blocks are there already: they stay put).
        self.offload = cpu_offload and device.type != "cpu"
        _check_parallel(parallel, components, self.offload, layerwise=offload_blocks is not None)
        self.experts = Experts(components.transformers, device, self.offload and offload_blocks is None)
        # Sequence parallelism runs our blocks too (compiled or not): their self-attention is pluggable.
        self.own_blocks = acceleration.own_blocks(device) or parallel.sequence is not None
        dtype = components.transformers[0].dtype
        acceleration.prepare_transformers([t.blocks for t in components.transformers], device, dtype)
        # Our blocks: one wrapper per block, compiled all running the same compiled code (regional
        # compilation), each with its self- and cross-attention sites (models/diffusion_attention.py).
        self.blocks = [self._own_blocks(t.blocks, dtype) if self.own_blocks else t.blocks
                       for t in components.transformers]
        if parallel.hsdp_mesh is not None:
            for blocks in self.blocks:
                shard_with_hsdp(blocks, parallel.hsdp_mesh)
        if offload_blocks is not None:  # each expert its own ring (diffusion/layerwise_offload.py)
            for transformer, blocks in zip(components.transformers, self.blocks):
                offload_blocks(blocks, device)
                transformer.to(device)  # the rest of it; the offloaded blocks' views are there already
        vae = components.vae.config
        self.temporal, self.spatial = vae.scale_factor_temporal, vae.scale_factor_spatial
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial)
        self.encoder = PromptEncoder(components.text_encoder, components.tokenizer)
        if self.offload:
            for module in (components.text_encoder, components.vae):  # no text encoder on ranks > 0
                if module is not None:
                    module.to("cpu")

    def _own_blocks(self, blocks: Any, dtype: torch.dtype) -> list[CompilableWanBlock]:
        sites = self.acceleration.attention_sites(ROLES, len(blocks), self.device, dtype, "Wan2.2")
        compile_fn = self.acceleration.compile_fn if self.compiled else None
        return [CompilableWanBlock(b, compile_fn, (sites["self"][i], sites["cross"][i])) for i, b in enumerate(blocks)]

    @classmethod
    def load(cls, model_path: str | Path, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
             vae_use_slicing: bool = False, vae_use_tiling: bool = False, cpu_offload: bool = False,
             acceleration: DenoiserAcceleration = DenoiserAcceleration(), boundary_ratio: float | None = None,
             flow_shift: float | None = None, parallel: DiffusionParallelism = DiffusionParallelism(),
             offload_blocks: OffloadBlocks | None = None) -> WanModel:
        # Only rank 0 of a parallel stage prepares requests: the others need no text encoder.
        # Offloaded: the transformers load into CPU memory, and only what is not offloaded moves.
        transformer_device = torch.device("cpu") if offload_blocks is not None else device
        components = load_components(model_path, device=device, dtype=dtype, dummy=dummy,
                                     boundary_ratio=boundary_ratio, flow_shift=flow_shift,
                                     quantization=acceleration.quantization, text_encoder=parallel.rank == 0,
                                     transformer_device=transformer_device)
        set_vae_options(components.vae, vae_use_slicing, vae_use_tiling)
        return cls(components, device=device, cpu_offload=cpu_offload, acceleration=acceleration, parallel=parallel,
                   offload_blocks=offload_blocks)

    @property
    def fps(self) -> int:
        return FPS_TI2V if self.c.expand_timesteps else FPS_A14B

    @property
    def size_multiple(self) -> int:
        """Heights and widths are multiples of a latent patch: 16 pixels (A14B), 32 (TI2V-5B's VAE)."""
        return self.spatial * self.c.transformers[0].config.patch_size[1]

    # --- one request -----------------------------------------------------------------------
    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> WanRequest:
        text = diffusion_inputs.prompt_text(request)
        negative = diffusion_inputs.negative_prompt(request)
        image = diffusion_inputs.input_image(request)
        self._check_image(image)
        height, width, frames = self._size(params)
        guidance = DEFAULT_GUIDANCE_SCALE if params.guidance_scale is None else params.guidance_scale
        if params.guidance_scale_2 is not None and self.c.boundary_ratio is None:
            raise ValueError("guidance_scale_2 applies to two-expert models (Wan2.2 A14B); this one has one "
                             "transformer")
        guidance_2 = guidance if params.guidance_scale_2 is None else params.guidance_scale_2
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator("cpu").manual_seed(seed)
        dtype = self.c.transformers[0].dtype
        with visiting(self.c.text_encoder, self.device, self.offload):
            prompt = self.encoder.encode(text, self.device).to(dtype)
            # diffusers' rule: guidance runs with guidance_scale > 1, against "" without a negative prompt.
            neg = self.encoder.encode(negative or "", self.device).to(dtype) if guidance > 1.0 else None
        n = params.num_outputs_per_prompt
        latents = self._noise(n, frames, height, width, generator)
        self._check_sequence(latents)
        condition = None
        if image is not None:
            with visiting(self.c.vae, self.device, self.offload):
                condition = image_condition(self, image, n, frames, height, width)
        timesteps, experts, solver = self._schedule(params.num_inference_steps)
        scales = tuple(guidance if e == 0 else guidance_2 for e in experts)
        return WanRequest((frames, height, width), latents, timesteps, solver, experts, scales, prompt, neg, frames,
                          height, width, condition)

    def _check_image(self, image: torch.Tensor | None) -> None:
        if image is None and self.c.needs_image:
            raise ValueError("this Wan image-to-video model needs an input image (the first frame): the request "
                             "has none")
        if image is not None and not self.c.takes_image:
            raise ValueError("this Wan model generates video from text; it takes no input image (use an "
                             "image-to-video model: Wan2.2 I2V-A14B or TI2V-5B)")

    def _size(self, params: DiffusionSamplingParams) -> tuple[int, int, int]:
        height, width = params.height or DEFAULT_HEIGHT, params.width or DEFAULT_WIDTH
        frames = params.num_frames or DEFAULT_NUM_FRAMES
        for name, value in (("height", height), ("width", width)):
            if value % self.size_multiple:
                raise ValueError(f"{name}={value} is invalid for this model: must be a multiple of "
                                 f"{self.size_multiple}")
        if (frames - 1) % self.temporal:
            raise ValueError(f"num_frames={frames} is invalid: must be {self.temporal}k + 1 (e.g. 81)")
        return height, width, frames

    def _check_sequence(self, latents: torch.Tensor) -> None:
        """Sequence parallelism: a length its mode cannot split fails this request (ValueError)."""
        if self.parallel.sequence is not None:
            _, p_h, p_w = self.c.transformers[0].config.patch_size
            self.parallel.sequence.check_length(latents.shape[2] * (latents.shape[3] // p_h) * (latents.shape[4] // p_w))

    def _noise(self, n: int, frames: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        shape = (n, self.c.z_dim, (frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def _schedule(self, steps: int) -> tuple[torch.Tensor, tuple[int, ...], Any]:
        """The pipeline's timesteps for this request alone, the expert of each, and its solver."""
        scheduler = type(self.c.scheduler).from_config(self.c.scheduler.config)
        scheduler.set_timesteps(steps)  # on the CPU: the expert switch is decided here, not per step
        experts = (0,) * len(scheduler.timesteps)
        if self.c.boundary_ratio is not None:
            boundary = self.c.boundary_ratio * scheduler.config.num_train_timesteps
            experts = tuple(0 if high else 1 for high in (scheduler.timesteps >= boundary).tolist())
        try:
            solver = solver_for(scheduler)
        except torch.linalg.LinAlgError as e:
            raise ValueError(f"num_inference_steps={steps} gives a singular UniPC update for this scheduler: {e}")
        return scheduler.timesteps.to(self.device), experts, solver

    # --- a denoiser batch ------------------------------------------------------------------
    def make_batch(self, groups: Sequence[Any]) -> WanBatch:
        dtype = self.c.transformers[0].dtype
        hidden, timesteps, prompts = [], [], []
        for g in groups:
            p: WanRequest = g.prepared
            sample = g.latents if p.image is None else p.image.model_input(g.latents)
            hidden.append(sample.to(dtype))
            timesteps.append(self._timesteps(p, g.timestep, g.num_rows, sample))
            prompts.append((p.negative if g.uncond else p.prompt).expand(g.num_rows, -1, -1))
        return WanBatch(torch.cat(hidden), torch.cat(timesteps), torch.cat(prompts), groups[0].expert,
                        tuple(g.step for g in groups for _ in range(g.num_rows)))

    def _timesteps(self, p: WanRequest, t: torch.Tensor, rows: int, sample: torch.Tensor) -> torch.Tensor:
        """[rows], or with expand_timesteps one per token [rows, tokens]: 0 on an input image's frame."""
        if not self.c.expand_timesteps:
            return t.expand(rows)
        mask = sample.new_ones(sample.shape[2:], dtype=torch.float32) if p.image is None else \
            p.image.first_frame_mask[0][0]
        _, p_h, p_w = self.c.transformers[0].config.patch_size
        return (mask[:, ::p_h, ::p_w] * t).flatten().unsqueeze(0).expand(rows, -1)

    def embed(self, batch: WanBatch) -> Embedded:
        return denoiser.embed(self.experts[batch.expert], batch, per_frame=self.own_blocks)

    def modulated_input(self, emb: Embedded) -> torch.Tensor:
        raise ValueError("TeaCache does not support Wan (refused at startup: diffusion/tea_cache.py)")

    def block_input(self, emb: Embedded) -> torch.Tensor:
        return emb.hidden

    def run_blocks(self, emb: Embedded, rows: torch.Tensor | None) -> torch.Tensor:
        return self.run_block_range(emb, rows, None, 0, None)[0]

    def num_blocks(self, emb: Embedded) -> int:
        return len(self.blocks[emb.expert])

    def blocks_state(self, emb: Embedded) -> tuple[torch.Tensor, None]:
        return emb.hidden, None  # the prompt only conditions (cross-attention): the blocks do not update it

    def run_block_range(self, emb: Embedded, rows: torch.Tensor | None, state: tuple[torch.Tensor, None] | None,
                        start: int, end: int | None) -> tuple[torch.Tensor, None]:
        steps = rows_steps(emb.steps, rows) if self.acceleration.attention.active else None
        kernels = contextlib.nullcontext() if self.own_blocks else self.acceleration.attention_context(self.device)
        with kernels, row_steps(steps):
            hidden = denoiser.run_block_range(self.blocks[emb.expert], emb, rows, self.own_blocks,
                                              None if state is None else state[0], start, end, self.parallel.sequence)
        return hidden, None

    def finish(self, emb: Embedded, hidden: torch.Tensor) -> torch.Tensor:
        return denoiser.finish(self.experts[emb.expert], emb, hidden)

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return uncond + scale * (cond - uncond)

    # --- output ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, prepared: Sequence[WanRequest], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Requests finishing in one step share a size (their batch key): one VAE call decodes all."""
        vae = self.c.vae
        finals = [lat if p.image is None else p.image.final(lat) for p, lat in zip(prepared, latents)]
        with visiting(vae, self.device, self.offload):
            x = torch.cat(finals).to(vae.device, vae.dtype)
            mean, std = self.latent_stats(x)
            video = vae.decode(x / (1.0 / std) + mean, return_dict=False)[0]
        frames = self.video_processor.postprocess_video(video, output_type="pt").float().cpu()
        return [{"video": part} for part in torch.split(frames, [lat.shape[0] for lat in latents])]

    def latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and std, shaped [1, z, 1, 1, 1] like `like`."""
        config = self.c.vae.config
        return tuple(torch.tensor(values).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
                     for values in (config.latents_mean, config.latents_std))

    def describe(self) -> dict[str, Any]:
        t = self.c.transformers[0]
        return {"pipeline": self.c.pipeline_class, "transformer": type(t).__name__,
                "transformer_layers": t.config.num_layers, "experts": len(self.c.transformers),
                "boundary_ratio": self.c.boundary_ratio,
                "dtype": str(t.dtype).removeprefix("torch."), "cpu_offload": self.offload,
                **self.acceleration.describe(self.device, list(self.c.transformers))}

    def video_info(self) -> VideoInfo:
        # What a video API needs before a request runs (entrypoints/openai/serving_video.py).
        return VideoInfo(fps=self.fps, frame_step=self.temporal, size_multiple=self.size_multiple,
                         default_size=f"{DEFAULT_WIDTH}x{DEFAULT_HEIGHT}",
                         image_input="required" if self.c.needs_image else "optional" if self.c.takes_image else "none")


def _check_parallel(parallel: DiffusionParallelism, components: WanComponents, offload: bool,
                    layerwise: bool = False) -> None:
    """What of the stage's parallelism Wan2.2 runs: sequence parallelism and HSDP; ValueError
    with the reason for the rest."""
    if parallel.vae is not None:
        raise ValueError("vae_patch_parallel_size > 1 is not implemented for Wan2.2: its VAE decodes a video frame "
                         "by frame through a causal time cache; the patch-parallel decode splits Qwen-Image's "
                         "single frame")
    if parallel.hsdp_mesh is not None and offload:
        raise ValueError("use_hsdp with enable_cpu_offload: Wan2.2's offload moves the expert not in use to the CPU, "
                         "and HSDP's sharded weights stay on their devices; choose one")
    if parallel.hsdp_mesh is not None and layerwise:  # config refuses it first (diffusion_accel.py)
        raise ValueError("enable_layerwise_offload and use_hsdp: HSDP shards the blocks' weights over the ranks, "
                         "layerwise offload keeps them whole in CPU memory: choose one")
    if parallel.sequence is not None:
        for transformer in components.transformers:
            parallel.sequence.check_heads(transformer.config.num_attention_heads)
