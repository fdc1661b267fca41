"""One request's state in the diffusion engine: its parameters, its prepared inputs, its sample."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import OutputKind, StageRequest


@dataclass
class DiffusionRequest:
    request: StageRequest
    params: DiffusionSamplingParams
    prepared: Any = None  # the model's PreparedRequest, made when the request reaches the head of the queue
    latents: torch.Tensor | None = None  # the current sample
    step: int = 0  # denoising steps done

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_kind(self) -> OutputKind:
        return self.request.output_kind

    @property
    def is_prepared(self) -> bool:
        return self.prepared is not None

    @property
    def batch_key(self) -> Hashable:
        return self.prepared.batch_key

    @property
    def num_steps(self) -> int:
        return len(self.prepared.timesteps)

    @property
    def finished(self) -> bool:
        return self.step >= self.num_steps

    def start(self, prepared: Any) -> None:
        self.prepared = prepared
        self.latents = prepared.latents

    def timestep(self) -> torch.Tensor:
        return self.prepared.timesteps[self.step]

    def expert(self) -> int:
        """Which of the model's denoisers runs this request's current step (two-expert models)."""
        return self.prepared.expert(self.step)

    def advance(self, velocity: torch.Tensor) -> None:
        """One step of the request's own solver (models/diffusion_solvers.py), which keeps its state."""
        self.latents = self.prepared.solver.step(velocity, self.latents)
        self.step += 1
