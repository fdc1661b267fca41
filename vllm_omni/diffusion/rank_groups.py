"""The torch.distributed groups of one diffusion stage's world, built the same way on every rank.

torch.distributed asks every process to create every group, members or not, in the same order;
`build_groups` does that from the stage's DiffusionParallelConfig (config/diffusion_parallel.py
explains the rank layout) and returns what this rank belongs to: its CFG branch (the ranks that
compute the same rows together), the model's groups (sequence parallelism, VAE patches, the HSDP
mesh) and the branch's agreement on TeaCache decisions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.model_executor.layers.diffusion_parallel import DiffusionParallelism, PatchGroup
from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelGroup


@dataclass(frozen=True, eq=False)
class RankGroups:
    layout: DiffusionParallelConfig
    rank: int
    device: torch.device
    branch: int  # the CFG branch this rank computes (0: conditional rows, 1: unconditional ones)
    branch_group: dist.ProcessGroup | None  # None: the branch is this rank alone
    model: DiffusionParallelism

    @property
    def branch_leader(self) -> int:
        """The branch's lowest rank: it returns the branch's velocities to rank 0."""
        return self.branch * self.layout.branch_size

    def agree(self, decisions: list[bool]) -> list[bool]:
        """The branch leader's decisions, on every rank of the branch (TeaCache: ranks that run the
        blocks together must skip the same rows, or their collectives would not match)."""
        if self.branch_group is None:
            return decisions
        flags = torch.tensor(decisions, dtype=torch.uint8, device=self.device)
        dist.broadcast(flags, src=self.branch_leader, group=self.branch_group)
        return [bool(f) for f in flags.tolist()]


def build_groups(layout: DiffusionParallelConfig, rank: int, device: torch.device) -> RankGroups:
    """Call on every rank after init_process_group; the same calls in the same order everywhere."""
    cfg_rank, _, ring_rank, ulysses_rank = layout.coordinates(rank)
    branch_size = layout.branch_size
    branch_group = _mine(rank, [list(range(b * branch_size, (b + 1) * branch_size))
                                for b in range(layout.cfg_parallel_size)])
    sequence = _sequence_group(layout, rank, ring_rank, ulysses_rank)
    vae_size = layout.vae_patch_parallel_size
    vae_group = _mine(rank, [list(range(vae_size))])
    vae = PatchGroup(vae_size, rank, vae_group) if vae_group is not None else None
    mesh = None
    if layout.hsdp_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        replicate, shard = layout.hsdp_shape
        shape, names = ((replicate, shard), ("replicate", "shard")) if replicate > 1 else ((shard,), ("shard",))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return RankGroups(layout, rank, device, cfg_rank, branch_group,
                      DiffusionParallelism(rank, sequence, vae, mesh))


def _sequence_group(layout: DiffusionParallelConfig, rank: int, ring_rank: int,
                    ulysses_rank: int) -> SequenceParallelGroup | None:
    """Grids of ring x Ulysses ranks, one per (CFG branch, HSDP replica); Ulysses groups are runs of
    neighbouring ranks, rings go across them."""
    u, r = layout.ulysses_degree, layout.ring_degree
    if u * r == 1:
        return None
    num_grids = layout.cfg_parallel_size * layout.data_parallel_size
    grids = [list(range(g * u * r, (g + 1) * u * r)) for g in range(num_grids)]
    ulysses = _mine(rank, [grid[i * u:(i + 1) * u] for grid in grids for i in range(r)])
    rings = [grid[i::u] for grid in grids for i in range(u)]
    ring = _mine(rank, rings)
    grid_group = _mine(rank, grids)
    my_ring = next(members for members in rings if rank in members)
    return SequenceParallelGroup(u, ulysses_rank, ulysses, r, ring_rank, ring, tuple(my_ring), grid_group,
                                 layout.ulysses_mode)


def _mine(rank: int, groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """Create every group of more than one rank (all ranks must); return the one holding `rank`."""
    found = None
    for members in groups:
        if len(members) < 2:
            continue
        group = dist.new_group(list(members))
        if rank in members:
            found = group
    return found
