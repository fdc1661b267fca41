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
`finish` (output head); DBCache (db_cache.py) runs block ranges (`run_block_range`). Models
implement the protocols structurally; nothing here is imported by model code.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_omni.model_executor.models.diffusion_solvers import FlowSolver
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest


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


class DiffusionModel(Protocol):
    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> PreparedRequest:
        """Encode prompts (and input images), draw the seeded noise, compute the schedule.
        ValueError: the request cannot run (bad image, size over the limit...)."""
        ...

    def make_batch(self, groups: Sequence[RowGroup]) -> Any:
        """A picklable batch (tensors only) of the groups' rows, in order; the groups share a
        batch_key and an expert."""
        ...

    def embed(self, batch: Any) -> Any: ...
    def modulated_input(self, embedded: Any) -> torch.Tensor: ...  # [rows, ...]

    def block_input(self, embedded: Any) -> torch.Tensor: ...  # [rows, seq, dim]: what the blocks update

    def run_blocks(self, embedded: Any, rows: torch.Tensor | None) -> torch.Tensor:
        """The blocks' output for `rows` (an index tensor; None: all rows)."""
        ...

    def num_blocks(self, embedded: Any) -> int: ...  # of the transformer (expert) the batch runs on

    def blocks_state(self, embedded: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the blocks update: the image stream, and the text stream of joint blocks (None
        where the text only conditions, e.g. Wan's cross-attention)."""
        ...

    def run_block_range(self, embedded: Any, rows: torch.Tensor | None,
                        state: tuple[torch.Tensor, torch.Tensor | None], start: int,
                        end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks [start, end) over `rows` (None: all) from `state` (those rows' streams): DBCache."""
        ...

    def finish(self, embedded: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: the velocity prediction [rows, seq, channels] of the latents."""
        ...

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor: ...

    def decode(self, prepared: Sequence[Any], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Final latents -> one dict of typed tensors per request ({"image": [n, 3, H, W]} or
        {"video": [n, frames, 3, H, W]}, floats in [0, 1])."""
        ...

    def describe(self) -> dict[str, Any]: ...
