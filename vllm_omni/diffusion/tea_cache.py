"""TeaCache (Timestep Embedding Aware Cache, arXiv 2411.19108), per row of a batch.

Between two steps a row's transformer blocks change its hidden states by a residual that
drifts slowly when the block input barely moves. TeaCache measures that movement on the first
block's modulated input (relative L1 distance to the previous step), rescales it with a
polynomial fitted per model, and accumulates it; while the sum stays under `rel_l1_thresh`
the row skips the blocks and adds its cached residual instead. The first step of a row always
computes. Each row (request x CFG branch x output image) keeps its own state, so requests that
join a running batch at any step are unaffected by the others; rows that compute run the
blocks as one sub-batch. The decision rule and the Qwen-Image coefficients are upstream
vLLM-Omni's (from ComfyUI-TeaCache).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Rescaling polynomial (highest power first) of the relative L1 distance, per transformer class.
MODEL_COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "QwenImageTransformer2DModel": (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02),
}
DEFAULT_REL_L1_THRESH = 0.2
# Transformers TeaCache does not run with, and why.
UNSUPPORTED = {"WanTransformer3DModel": "Wan2.2's steps switch between two experts, whose block residuals differ"}


@dataclass(frozen=True)
class TeaCacheConfig:
    rel_l1_thresh: float = DEFAULT_REL_L1_THRESH
    coefficients: tuple[float, ...] = MODEL_COEFFICIENTS["QwenImageTransformer2DModel"]

    @classmethod
    def for_model(cls, transformer_class: str, settings: Mapping[str, Any]) -> TeaCacheConfig:
        """`settings`: --cache-config (already checked by the config layer)."""
        if transformer_class in UNSUPPORTED:
            raise ValueError(f"TeaCache does not support {transformer_class}: {UNSUPPORTED[transformer_class]}")
        coefficients = settings.get("coefficients") or MODEL_COEFFICIENTS.get(transformer_class)
        if coefficients is None:
            raise ValueError(f"TeaCache has no coefficients for {transformer_class}; give them in --cache-config "
                             f"(known models: {sorted(MODEL_COEFFICIENTS)})")
        return cls(float(settings.get("rel_l1_thresh", DEFAULT_REL_L1_THRESH)), tuple(float(c) for c in coefficients))

    def rescale(self, distance: float) -> float:
        result = 0.0
        for c in self.coefficients:  # Horner's rule, highest power first
            result = result * distance + c
        return result


@dataclass
class _RowState:
    previous_input: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    accumulated: float = 0.0


class TeaCache:
    def __init__(self, config: TeaCacheConfig,
                 agree: Callable[[list[bool]], list[bool]] | None = None) -> None:
        self.config = config
        # Ranks that run the blocks together (sequence parallelism, HSDP) must skip the same rows:
        # `agree` returns their leader's decisions (process_group.py); None on a rank of its own.
        self.agree = agree
        self._rows: dict[Hashable, _RowState] = {}
        self.computed = 0  # rows that ran the blocks
        self.skipped = 0  # rows that reused their residual

    def run(self, keys: Sequence[Hashable], modulated: torch.Tensor, block_input: torch.Tensor,
            run_blocks: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """The blocks' output for every row: computed for rows that must, cached for the others."""
        states = [self._rows.setdefault(k, _RowState()) for k in keys]
        compute = self._decide(states, modulated)
        for state, row_input in zip(states, modulated):
            state.previous_input = row_input.detach().clone()
        rows = [i for i, must in enumerate(compute) if must]
        self.computed += len(rows)
        self.skipped += len(keys) - len(rows)
        if len(rows) == len(keys):
            out = run_blocks(None)
        else:
            out = block_input.clone()
            for i, must in enumerate(compute):
                if not must:
                    out[i] = block_input[i] + states[i].residual
            if rows:
                index = torch.tensor(rows, device=block_input.device)
                out[index] = run_blocks(index)
        for i in rows:
            states[i].residual = out[i] - block_input[i]
        return out

    def _decide(self, states: list[_RowState], modulated: torch.Tensor) -> list[bool]:
        """Per row: run the blocks? A row's first step always does. The distances of all rows
        are computed together: one device-to-host copy per step, not one per row."""
        known = [i for i, s in enumerate(states) if s.previous_input is not None and s.residual is not None]
        compute = [True] * len(states)
        if not known:
            return compute
        current = modulated[known].flatten(1)
        previous = torch.stack([states[i].previous_input for i in known]).flatten(1)
        distances = ((current - previous).abs().mean(1) / (previous.abs().mean(1) + 1e-8)).tolist()
        for i, distance in zip(known, distances):
            states[i].accumulated += abs(self.config.rescale(distance))
            compute[i] = states[i].accumulated >= self.config.rel_l1_thresh
        if self.agree is not None:
            compute = self.agree(compute)
        for i in known:
            if compute[i]:
                states[i].accumulated = 0.0
        return compute

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Forget the rows of requests that finished or were aborted."""
        keep = set(keys)
        self._rows = {k: s for k, s in self._rows.items() if k in keep}
