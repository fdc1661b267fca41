"""One denoising step of the running batch: the denoiser forward(s) and classifier-free guidance.

Conditional rows of every request and unconditional rows of the requests that use guidance
go into ONE forward (rows of different prompt lengths are zero-padded and masked), so a batch
of B guided requests costs one forward of 2B rows instead of 2B forwards. With
`cfg_parallel_size 2` the unconditional rows run on other ranks at the same time; with sequence
parallelism or HSDP the stage's ranks run each forward together (process_group.py).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from vllm_omni.diffusion.model import DiffusionModel, RowGroup
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.tea_cache import TeaCache


def run_denoiser(model: DiffusionModel, batch: Any, cache: TeaCache | None = None,
                 keys: Sequence[Hashable] = ()) -> torch.Tensor:
    """The velocity prediction for every row of `batch`; with a cache, rows may skip the blocks."""
    emb = model.embed(batch)
    if cache is None:
        hidden = model.run_blocks(emb, None)
    else:
        cache.retain(keys)  # every running request is in every step: other rows are gone
        hidden = cache.run(keys, model.modulated_input(emb), model.block_input(emb),
                           lambda rows: model.run_blocks(emb, rows))
    return model.finish(emb, hidden)


class Denoiser:
    """Velocity predictions for the running requests, guidance applied."""

    def __init__(self, model: DiffusionModel, cache: TeaCache | None = None, group: Any = None) -> None:
        self.model = model
        self.cache = cache
        self.group = group  # process_group.DiffusionProcessGroup: the stage's other ranks

    def velocities(self, requests: Sequence[DiffusionRequest]) -> list[torch.Tensor]:
        cond = [self._group(r, uncond=False) for r in requests]
        guided = [r for r in requests if r.prepared.do_cfg]
        uncond = [self._group(r, uncond=True) for r in guided]
        cond_keys, uncond_keys = _keys(requests, False), _keys(guided, True)
        if self.group is not None and self.group.cfg_size == 2:  # the branches on their own ranks
            cond_out, uncond_out = self._forward([(cond, cond_keys), (uncond, uncond_keys) if uncond else None])
        else:
            out = self._forward([(cond + uncond, cond_keys + uncond_keys)])[0]
            cond_out, uncond_out = out[:len(cond_keys)], out[len(cond_keys):]
        cond_parts = torch.split(cond_out, [g.num_rows for g in cond])
        if not guided:
            return list(cond_parts)
        uncond_parts = dict(zip((id(r) for r in guided), torch.split(uncond_out, [g.num_rows for g in uncond])))
        return [self.model.combine_cfg(c, uncond_parts[id(r)], r.prepared.true_cfg_scale) if r.prepared.do_cfg else c
                for r, c in zip(requests, cond_parts)]

    def _forward(self, branches: list[tuple[list[RowGroup], list[Hashable]] | None]) -> list[torch.Tensor | None]:
        """Each branch's velocities: here, or over the stage's ranks."""
        batches = [None if b is None else (self.model.make_batch(b[0]), b[1]) for b in branches]
        if self.group is None:
            return [self._compute(*batches[0])]
        return self.group.forward(self._compute, batches)

    def _compute(self, batch: Any, keys: Sequence[Hashable]) -> torch.Tensor:
        return run_denoiser(self.model, batch, self.cache, keys)

    @staticmethod
    def _group(request: DiffusionRequest, uncond: bool) -> RowGroup:
        return RowGroup(request.prepared, request.latents, request.timestep(), uncond)


def _keys(requests: Sequence[DiffusionRequest], uncond: bool) -> list[Hashable]:
    """TeaCache row keys: one per (request, branch, output image)."""
    return [(r.request_id, uncond, i) for r in requests for i in range(r.latents.shape[0])]
