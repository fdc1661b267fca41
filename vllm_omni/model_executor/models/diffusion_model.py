"""The contract between the diffusion engine and a diffusion model (e.g. Qwen-Image).

The engine owns the loop: which requests share a step, the flow-matching update, caches,
CFG parallelism. The model owns everything model-specific: prompt encoding, initial latents
and the timestep schedule (`prepare`), one denoiser forward over a batch of rows, how the
conditional and unconditional predictions combine, and decoding latents into pixels.

The denoiser forward is split in four parts so that a cache (TeaCache) can skip the
transformer blocks per row: `embed` (inputs -> block inputs), `modulated_input` (the signal
TeaCache compares between steps), `run_blocks` (the expensive part, for a subset of rows),
`finish` (output head). A diffusion model subclasses `DiffusionModel` (as AR models subclass
`StageModel` and single-pass ones `GenerationModel`); the engine calls its hooks and never probes
it. `PreparedRequest` is a protocol: each model keeps its own per-request state.

The runtime calls, in order:
  model = cls.load(model_path, device=..., dtype=..., dummy=..., ...)   # once (diffusion/cfg_parallel.ModelSpec)
  model.describe()                           # once, what the stage reports when it is ready
  prepared = model.prepare(request, params)  # once a request, when it reaches the head of the queue
  batch = model.make_batch(groups)           # each step, rows of requests sharing a batch_key
  embedded = model.embed(batch)              # each step: the denoiser's forward, in parts
  model.modulated_input(embedded)            #   (only with TeaCache: the signal it compares)
  model.block_input(embedded)
  hidden = model.run_blocks(embedded, rows)
  model.finish(embedded, hidden)
  model.combine_cfg(cond, uncond, scale)     # each step of a request with CFG
  model.decode(prepared, latents)            # once a request, after its last step
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


class DiffusionModel:
    """Base class of every diffusion stage model (see the module docstring); every hook raises
    until the model defines it."""

    @classmethod
    def load(cls, model_path: str, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
             **options: Any) -> DiffusionModel:
        """The model on `device`; `dummy`: random weights. `options`: the stage's VAE slicing and
        tiling, CPU offload and acceleration (diffusion/cfg_parallel.ModelSpec)."""
        raise NotImplementedError

    def prepare(self, request: StageRequest, params: DiffusionSamplingParams) -> PreparedRequest:
        """Encode prompts (and input images), draw the seeded noise, compute the schedule.
        ValueError: the request cannot run (bad image, size over the limit...)."""
        raise NotImplementedError

    def make_batch(self, groups: Sequence[RowGroup]) -> Any:
        """A picklable batch (tensors only) of the groups' rows, in order; the groups share a batch_key."""
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

    def finish(self, embedded: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: the velocity prediction [rows, seq, channels] of the latents."""
        raise NotImplementedError

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided prediction from the conditional and unconditional ones: plain CFG by default."""
        return uncond + scale * (cond - uncond)

    def decode(self, prepared: Sequence[Any], latents: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Final latents -> one dict of typed tensors per request ({"image": [n, 3, H, W] in [0, 1]})."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the stage reports when it is ready ("transformer": its name, which TeaCache keys on)."""
        raise NotImplementedError
