"""`enable_cpu_offload` for the native diffusion models: components wait on the CPU and visit the
device for their calls.

The text encoder and the VAE run once per request, so they visit the device for each call.
The transformer runs every step and stays; a model with several (Wan2.2 A14B's two experts)
keeps only the one in use on the device and moves the other out when a step needs it (not
with layerwise offload, where every transformer's blocks but the first wait on the CPU already).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# Layerwise offload (diffusion/layerwise_offload.py, `enable_layerwise_offload`): called with the
# blocks a transformer runs, in order, while its weights are still in CPU memory; it keeps their
# weights there and hooks them. The model moves the rest of the transformer to the device after.
OffloadBlocks = Callable[[Sequence[torch.nn.Module], torch.device], Any]


@contextlib.contextmanager
def visiting(module: Any, device: torch.device, offload: bool) -> Iterator[None]:
    """`module` on `device` for the block (with offload; else it is there already)."""
    if not offload:
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to("cpu")


class Experts:
    """Transformers of which each step uses one: all on the device, or with offload only the
    one in use (the others wait on the CPU)."""

    def __init__(self, modules: Sequence[Any], device: torch.device, offload: bool) -> None:
        self.modules = tuple(modules)
        self.device = device
        self.offload = offload
        self._resident = 0
        if offload:
            for module in self.modules[1:]:
                module.to("cpu")

    def __getitem__(self, index: int) -> Any:
        if self.offload and index != self._resident:
            self.modules[self._resident].to("cpu")  # first: both need not fit at once
            self.modules[index].to(self.device)
            self._resident = index
        return self.modules[index]

    def __len__(self) -> int:
        return len(self.modules)
