"""What a diffusion model sees of its stage's process world: the groups it runs its parts over.

The diffusion engine (vllm_omni/diffusion/process_group.py) starts the ranks and builds the
groups; a model receives them as `DiffusionParallelism` when it is loaded and uses each where it
applies:

- `sequence`: sequence parallelism of its transformer's attention (sequence_parallel.py);
- `vae`: the ranks that decode bands of the latent's rows (`decode_row_bands`);
- `hsdp_mesh`: the device mesh its transformer blocks are sharded over (`shard_with_hsdp`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelGroup, even_split


@dataclass(frozen=True, eq=False)
class PatchGroup:
    """Ranks 0..size-1 of the stage, which decode one band of rows each; rank 0 assembles."""

    size: int
    rank: int
    group: dist.ProcessGroup


@dataclass(frozen=True, eq=False)
class DiffusionParallelism:
    rank: int = 0  # in the stage's world; rank 0 alone prepares requests (encodes prompts)
    sequence: SequenceParallelGroup | None = None
    vae: PatchGroup | None = None  # None: this rank does not decode in parallel
    hsdp_mesh: Any = None  # torch.distributed DeviceMesh (replicate x shard), or None

    @property
    def active(self) -> bool:
        """Whether the model has anything to split (CFG parallelism alone needs nothing of it)."""
        return self.sequence is not None or self.vae is not None or self.hsdp_mesh is not None


def shard_with_hsdp(modules: Iterable[torch.nn.Module], mesh: Any) -> None:
    """FSDP2: each module's parameters sharded over the mesh, gathered when its forward runs
    (reshard_after_forward), so a rank holds one block's full weights at a time. Said explicitly:
    each block is its own FSDP root, and by default a root keeps its weights gathered after its
    forward (for training's backward), which would leave every block whole."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)


@contextlib.contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """A sharded module's full parameters for code that calls its submodules directly (not
    through its forward); a collective: every rank of its shard group must enter."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def decode_row_bands(patch: PatchGroup, features: torch.Tensor, *, halo: int, scale: int,
                     decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """`decode` (spatially local: convolutions, upsampling) of `features` [..., H, W], split into
    `patch.size` bands of rows. Each rank decodes its band with `halo` extra rows on each side
    (the decoder's receptive field, in feature rows), keeps its own `scale` x rows and sends them
    to rank 0, which returns the whole output; the other ranks return None. Equal to one
    `decode(features)` up to float rounding when `halo` covers the receptive field."""
    rows = features.shape[-2]
    if rows < patch.size:  # every rank knows: no collective at all
        return decode(features) if patch.rank == 0 else None
    lengths = even_split(rows, patch.size)
    start = sum(lengths[:patch.rank])
    end = start + lengths[patch.rank]
    low, high = max(0, start - halo), min(rows, end + halo)
    out = decode(features[..., low:high, :])
    mine = out[..., (start - low) * scale:(end - low) * scale, :]
    padded = torch.zeros((*mine.shape[:-2], lengths[0] * scale, mine.shape[-1]), dtype=mine.dtype,
                         device=mine.device)
    padded[..., :mine.shape[-2], :] = mine
    parts = [torch.empty_like(padded) for _ in lengths] if patch.rank == 0 else None
    dist.gather(padded, parts, dst=dist.get_global_rank(patch.group, 0), group=patch.group)
    if patch.rank != 0:
        return None
    return torch.cat([p[..., :n * scale, :] for p, n in zip(parts, lengths)], dim=-2)
