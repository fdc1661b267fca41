"""A checkpoint tensor not read yet: a tensor-parallel rank reads only its shard of it.

Loaders of sharded parameters take it as they take a tensor (`.shape`, `.narrow(dim, start,
size)`); the strict loader (`models/utils.py`) reads it whole for every other parameter.
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
