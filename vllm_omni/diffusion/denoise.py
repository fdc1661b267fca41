"""One denoising step of the running batch: the denoiser forward(s) and classifier-free guidance.

Conditional rows of every request and unconditional rows of the requests that use guidance
go into ONE forward (rows of different prompt lengths are zero-padded and masked), so a batch
of B guided requests costs one forward of 2B rows instead of 2B forwards (one per expert when
the requests' steps run on different experts). With `cfg_parallel_size 2` the unconditional
rows run on other ranks at the same time; with sequence parallelism or HSDP the stage's ranks
run each forward together (process_group.py).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from vllm_omni.model_executor.models.diffusion_model import DiffusionModel, RowGroup
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.db_cache import DBCache, DBCacheConfig
from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig

Cache = TeaCache | DBCache


def build_cache(spec: tuple[str, dict[str, Any], bool] | None, transformer_class: str,
                agree: Callable[[list[bool]], list[bool]] | None = None) -> Cache | None:
    """The cache of `spec` = (cache_backend, cache_config, enable_cache_dit_summary); None: no cache.
    `agree`: on ranks that run the blocks together, their leader's skip decisions (process_group.py)."""
    if spec is None:
        return None
    backend, settings, summary = spec
    if backend == "tea_cache":
        return TeaCache(TeaCacheConfig.for_model(transformer_class, settings), agree=agree)
    return DBCache(DBCacheConfig.from_settings(settings), summary=summary, agree=agree)


def run_denoiser(model: DiffusionModel, batch: Any, cache: Cache | None = None,
                 keys: Sequence[Hashable] = ()) -> torch.Tensor:
    """The velocity prediction for every row of `batch`; with a cache, rows may skip blocks."""
    emb = model.embed(batch)
    if cache is None:
        hidden = model.run_blocks(emb, None)
    elif isinstance(cache, DBCache):
        hidden = cache.run(keys, model.num_blocks(emb), model.blocks_state(emb),
                           lambda rows, state, start, end: model.run_block_range(emb, rows, state, start, end))
    else:
        hidden = cache.run(keys, model.modulated_input(emb), model.block_input(emb),
                           lambda rows: model.run_blocks(emb, rows))
    return model.finish(emb, hidden)


class Denoiser:
    """Velocity predictions for the running requests, guidance applied."""

    def __init__(self, model: DiffusionModel, cache: Cache | None = None, group: Any = None) -> None:
        self.model = model
        self.cache = cache
        self.group = group  # process_group.DiffusionProcessGroup: the stage's other ranks
        self._retained: list[Hashable] = []  # the cache rows of the running requests

    def velocities(self, requests: Sequence[DiffusionRequest]) -> list[torch.Tensor]:
        """One guided velocity per request. Requests whose step runs on another expert (Wan2.2's
        high- and low-noise transformers) make their own forward."""
        self.retain(requests)
        by_expert: dict[int, list[DiffusionRequest]] = {}
        for r in requests:
            by_expert.setdefault(r.expert(), []).append(r)
        if len(by_expert) == 1:
            return self._guided(requests)
        results = {id(r): v for group in by_expert.values() for r, v in zip(group, self._guided(group))}
        return [results[id(r)] for r in requests]

    def retain(self, running: Sequence[DiffusionRequest]) -> None:
        """The cache keeps the rows of the running requests (at their current expert) only (the
        other ranks' caches too: their next forward brings the keys)."""
        self._retained = [*_keys(running, False), *_keys([r for r in running if r.prepared.do_cfg], True)]
        if self.cache is not None:
            self.cache.retain(self._retained)

    def _guided(self, requests: Sequence[DiffusionRequest]) -> list[torch.Tensor]:
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
        return [self.model.combine_cfg(c, uncond_parts[id(r)], r.prepared.cfg_scale(r.step)) if r.prepared.do_cfg
                else c for r, c in zip(requests, cond_parts)]

    def _forward(self, branches: list[tuple[list[RowGroup], list[Hashable]] | None]) -> list[torch.Tensor | None]:
        """Each branch's velocities: here, or over the stage's ranks."""
        batches = [None if b is None else (self.model.make_batch(b[0]), b[1]) for b in branches]
        if self.group is None:
            return [self._compute(*batches[0])]
        return self.group.forward(self._compute, batches, self._retained)

    def _compute(self, batch: Any, keys: Sequence[Hashable]) -> torch.Tensor:
        return run_denoiser(self.model, batch, self.cache, keys)

    @staticmethod
    def _group(request: DiffusionRequest, uncond: bool) -> RowGroup:
        return RowGroup(request.prepared, request.latents, request.timestep(), uncond, request.expert(), request.step)


def _keys(requests: Sequence[DiffusionRequest], uncond: bool) -> list[Hashable]:
    """Cache row keys: one per (request, branch, output image, expert running it)."""
    return [(r.request_id, uncond, i, r.expert()) for r in requests for i in range(r.latents.shape[0])]
