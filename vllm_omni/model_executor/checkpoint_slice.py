"""Checkpoint tensors not read yet: a tensor-parallel rank reads only its shard of them.

Loaders of sharded parameters take a `CheckpointSlice` as they take a tensor (`.shape`,
`.narrow(dim, start, size)`); the strict loader (`models/utils.py`) reads it whole for every
other parameter. A `DummyCheckpointTensor` stands in for one under load_format "dummy".
"""
from __future__ import annotations

import torch


class CheckpointSlice:
    """One tensor of an open safetensors file; valid while the file is open."""

    def __init__(self, handle, name: str) -> None:
        self._handle = handle  # safetensors.safe_open(...)
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        """Rows [start, start + size) along `dim`; only those bytes are read."""
        index = (slice(None),) * dim + (slice(start, start + size),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._handle.get_tensor(self._name)


class DummyCheckpointTensor:
    """Random values in place of a checkpoint tensor (load_format "dummy"). They depend only on
    the seed and the full shape the loader expects, so each rank's shard is the matching part
    of the one tensor a single-rank engine gets: TP=N and TP=1 run the same random model."""

    def __init__(self, seed: int, std: float) -> None:
        self.seed = seed
        self.std = std

    def materialize(self, shape: list[int] | torch.Size, like: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(device=like.device).manual_seed(self.seed)
        return torch.empty(shape, dtype=like.dtype, device=like.device).normal_(0.0, self.std, generator=generator)
