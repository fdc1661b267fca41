"""The contract between the diffusion engine and a diffusion model (e.g. Qwen-Image).

The engine owns the loop: which requests share a step, the flow-matching update, caches,
CFG parallelism. The model owns everything model-specific: prompt encoding, initial latents
and the timestep schedule (`prepare`), one denoiser forward over a batch of rows, how the
conditional and unconditional predictions combine, and decoding latents into pixels.

The denoiser forward is split in four parts so that a cache (TeaCache) can skip the
transformer blocks per row: `embed` (inputs -> block inputs), `modulated_input` (the signal
TeaCache compares between steps), `run_blocks` (the expensive part, for a subset of rows),
`finish` (output head). Models implement the protocols structurally; nothing here is imported
by model code. In a stage of several ranks (process_group.py) rank 0 alone prepares requests;
every rank runs the denoiser forwards of its CFG branch (and the decode, patch-parallel) on its
own model, which splits the work with the groups it was loaded with (`load(..., parallel=...)`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest


class PreparedRequest(Protocol):
    """What `DiffusionModel.prepare` returns for one request (model inputs + its schedule)."""

    batch_key: Hashable  # requests with equal keys can share one denoiser forward
    latents: torch.Tensor  # [n_outputs, seq, channels]: the initial noise
    sigmas: torch.Tensor  # [steps + 1] float32, ends at 0 (flow matching)
    timesteps: torch.Tensor  # [steps] float32, sigma * num_train_timesteps
    do_cfg: bool  # whether an unconditional branch runs
    true_cfg_scale: float
    height: int  # output size in pixels
    width: int


@dataclass(frozen=True)
class RowGroup:
    """The rows one request contributes to a denoiser batch for one CFG branch (n_outputs rows)."""

    prepared: Any  # the model's PreparedRequest
    latents: torch.Tensor  # [n_outputs, seq, channels], the current sample
    timestep: torch.Tensor  # 0-dim float32: the request's current timestep
    uncond: bool  # conditioned on the negative prompt (the unconditional branch of CFG)

    @property
    def num_rows(self) -> int:
        return self.latents.shape[0]


class DiffusionModel(Protocol):
    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> PreparedRequest:
        """Encode prompts (and input images), draw the seeded noise, compute the schedule.
        ValueError: the request cannot run (bad image, size over the limit...)."""
        ...

    def make_batch(self, groups: Sequence[RowGroup]) -> Any:
        """A picklable batch (tensors only) of the groups' rows, in order; the groups share a batch_key."""
        ...

    def embed(self, batch: Any) -> Any: ...
    def modulated_input(self, embedded: Any) -> torch.Tensor: ...  # [rows, ...]

    def block_input(self, embedded: Any) -> torch.Tensor: ...  # [rows, seq, dim]: what the blocks update

    def run_blocks(self, embedded: Any, rows: torch.Tensor | None) -> torch.Tensor:
        """The blocks' output for `rows` (an index tensor; None: all rows)."""
        ...

    def finish(self, embedded: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: the velocity prediction [rows, seq, channels] of the latents."""
        ...

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor: ...

    def decode(self, prepared: Sequence[Any], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Final latents -> one dict of typed tensors per request ({"image": [n, 3, H, W] in [0, 1]}).
        In a patch-parallel decode every decoding rank calls it; only rank 0 gets the outputs."""
        ...

    def describe(self) -> dict[str, Any]: ...
