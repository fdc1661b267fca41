"""The contract between the diffusion engine and a diffusion model (e.g. Qwen-Image).

The engine owns the loop: which requests share a step, the sampler update (the request's
solver), caches, CFG parallelism. The model owns everything model-specific: prompt encoding,
initial latents, the timestep schedule and its solver (`prepare`), which of its denoisers runs
a step (Wan2.2 has two experts) and with which guidance scale, one denoiser forward over a
batch of rows, how the conditional and unconditional predictions combine, and decoding latents
into pixels (images or videos).

The denoiser forward is split in four parts so that a cache (TeaCache) can skip the
transformer blocks per row: `embed` (inputs -> block inputs), `modulated_input` (the signal
TeaCache compares between steps), `run_blocks` (the expensive part, for a subset of rows),
`finish` (output head); DBCache (diffusion/db_cache.py) runs block ranges (`run_block_range`
over `blocks_state`, `num_blocks` of them). A diffusion model subclasses `DiffusionModel` (as AR models subclass
`StageModel` and single-pass ones `GenerationModel`); the engine calls its hooks and never probes
it. `PreparedRequest` is a protocol: each model keeps its own per-request state. In a stage of
several ranks (diffusion/process_group.py) rank 0 alone prepares requests; every rank runs the
denoiser forwards of its CFG branch (and the decode, patch-parallel) on its own model, which
splits the work with the groups it was loaded with (`load(..., parallel=...)`).

The runtime calls, in order:
  model = cls.load(model_path, device=..., dtype=..., dummy=..., ...)   # once (diffusion/process_group.ModelSpec)
  model.describe(), model.video_info()      # once, what the stage reports when it is ready
  prepared = model.prepare(request, params)  # once a request, when it reaches the head of the queue
  batch = model.make_batch(groups)           # each step, rows of requests sharing a batch_key
  embedded = model.embed(batch)              # each step: the denoiser's forward, in parts
  model.modulated_input(embedded)            #   (only with TeaCache: the signal it compares)
  model.block_input(embedded)
  hidden = model.run_blocks(embedded, rows)
  model.finish(embedded, hidden)
  model.combine_cfg(cond, uncond, scale)     # each step of a request with CFG
  model.decode(prepared, latents)            # once a request, after its last step
With DBCache, a step runs `num_blocks`, `blocks_state` and `run_block_range` (for ranges of the
blocks) in place of `block_input` and `run_blocks`.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_omni.model_executor.models.diffusion_solvers import FlowSolver
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest, VideoInfo


class PreparedRequest(Protocol):
    """What `DiffusionModel.prepare` returns for one request (model inputs + its schedule)."""

    batch_key: Hashable  # requests with equal keys can share one denoiser forward
    latents: torch.Tensor  # [n_outputs, ...]: the initial noise (Qwen-Image: [n, seq, channels])
    timesteps: torch.Tensor  # [steps], sigma * num_train_timesteps
    solver: FlowSolver  # this request's sampler update, with its own state (models/diffusion_solvers.py)
    do_cfg: bool  # whether an unconditional branch runs
    height: int  # output size in pixels
    width: int

    def expert(self, step: int) -> int:
        """Which denoiser runs `step` (0 unless the model has several, e.g. Wan2.2's two experts)."""
        ...

    def cfg_scale(self, step: int) -> float:
        """The guidance scale of `step` (Wan2.2: one per expert)."""
        ...


@dataclass(frozen=True)
class RowGroup:
    """The rows one request contributes to a denoiser batch for one CFG branch (n_outputs rows)."""

    prepared: Any  # the model's PreparedRequest
    latents: torch.Tensor  # [n_outputs, ...], the current sample
    timestep: torch.Tensor  # 0-dim: the request's current timestep
    uncond: bool  # conditioned on the negative prompt (the unconditional branch of CFG)
    expert: int = 0  # the denoiser that runs it: the groups of one batch share it
    step: int = 0  # the request's denoising step (attention quantization skips steps)

    @property
    def num_rows(self) -> int:
        return self.latents.shape[0]


class DiffusionModel:
    """Base class of every diffusion stage model (see the module docstring); every hook raises
    until the model defines it."""

    @classmethod
    def load(cls, model_path: str, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
             **options: Any) -> DiffusionModel:
        """The model on `device`; `dummy`: random weights. `options`: the stage's VAE slicing and
        tiling, CPU offload, acceleration, parallel groups and layerwise offload (diffusion/process_group.ModelSpec)."""
        raise NotImplementedError

    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> PreparedRequest:
        """Encode prompts (and input images), draw the seeded noise, compute the schedule.
        ValueError: the request cannot run (bad image, size over the limit...)."""
        raise NotImplementedError

    def make_batch(self, groups: Sequence[RowGroup]) -> Any:
        """A picklable batch (tensors only) of the groups' rows, in order; the groups share a
        batch_key and an expert."""
        raise NotImplementedError

    def embed(self, batch: Any) -> Any:
        """The batch's rows as the blocks' inputs (and whatever finish needs)."""
        raise NotImplementedError

    def modulated_input(self, embedded: Any) -> torch.Tensor:
        """[rows, ...]: the signal TeaCache compares between steps."""
        raise NotImplementedError

    def block_input(self, embedded: Any) -> torch.Tensor:
        """[rows, seq, dim]: what the blocks update."""
        raise NotImplementedError

    def run_blocks(self, embedded: Any, rows: torch.Tensor | None) -> torch.Tensor:
        """The blocks' output for `rows` (an index tensor; None: all rows)."""
        raise NotImplementedError

    def num_blocks(self, embedded: Any) -> int:
        """How many blocks the transformer (expert) the batch runs on has (DBCache)."""
        raise NotImplementedError

    def blocks_state(self, embedded: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the blocks update: the image stream, and the text stream of joint blocks (None
        where the text only conditions, e.g. Wan's cross-attention)."""
        raise NotImplementedError

    def run_block_range(self, embedded: Any, rows: torch.Tensor | None,
                        state: tuple[torch.Tensor, torch.Tensor | None], start: int,
                        end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks [start, end) over `rows` (None: all) from `state` (those rows' streams): DBCache."""
        raise NotImplementedError

    def finish(self, embedded: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: the velocity prediction [rows, seq, channels] of the latents."""
        raise NotImplementedError

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided prediction from the conditional and unconditional ones: plain CFG by default."""
        return uncond + scale * (cond - uncond)

    def decode(self, prepared: Sequence[Any], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Final latents -> one dict of typed tensors per request ({"image": [n, 3, H, W]} or
        {"video": [n, frames, 3, H, W]}, floats in [0, 1]).
        In a patch-parallel decode every decoding rank calls it; only rank 0 gets the outputs."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the stage reports when it is ready ("transformer": its name, which TeaCache keys on)."""
        raise NotImplementedError

    def video_info(self) -> VideoInfo | None:
        """A video model's frame rate, frame step, size multiple... (StageInfo.video); None: it
        makes images."""
        return None
