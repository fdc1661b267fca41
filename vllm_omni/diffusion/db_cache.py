"""`--cache-backend cache_dit`: cache-dit's DBCache (Dual Block Cache), per row of a batch.

cache-dit (vipshop/cache-dit) patches a diffusers transformer and keeps ONE cache context per
transformer call: its buffers are whole-batch tensors and its step counter counts pipeline
calls. Our engine batches requests that are at different steps and joins new ones mid-way, so
its contexts do not fit; this module implements DBCache's documented semantics and option names
with one state per row (request x CFG branch x output image, and expert for Wan2.2's two
transformers, as cache-dit keeps one context per transformer).

Each step, for every row:

1. The first `Fn_compute_blocks` blocks always run. Their residual (output - input) is compared
   with the one the row's last fully computed step left: diff = mean|R_prev - R| / mean|R_prev|.
2. The row reuses its cache when it is past warm-up (`max_warmup_steps`, every
   `warmup_interval`-th step computes), under `max_cached_steps` and
   `max_continuous_cached_steps` (-1: no limit; reaching the latter resets its count and
   computes), under `max_accumulated_residual_diff_threshold` (sum of its diffs) and
   diff < `residual_diff_threshold`. Reusing adds the cached residual of the middle blocks
   (image and, for joint blocks, text streams) instead of running them.
3. The last `Bn_compute_blocks` blocks always run.

`steps_computation_mask` (cache-dit's "step computation mask", one 0/1 per step: 1 computes)
overrides the decision: 1 always computes; 0 reuses when `steps_computation_policy` is "static"
(a fixed skip schedule: what benchmarks use, since on random weights a dynamic cache's skips
say little) or decides as above when it is "dynamic". The state of a row's steps and diffs is
what `--enable-cache-dit-summary` logs per request, in cache-dit's summary table.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DBCacheConfig:
    """cache-dit's option names; the defaults are upstream vLLM-Omni's (its DiffusionCacheConfig)."""

    Fn_compute_blocks: int = 1
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.24
    max_warmup_steps: int = 4
    warmup_interval: int = 1
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = 3
    max_accumulated_residual_diff_threshold: float | None = None
    steps_computation_mask: tuple[int, ...] | None = None
    steps_computation_policy: str = "dynamic"

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> DBCacheConfig:
        """`settings`: --cache-config, checked by the config layer (config/schema.py)."""
        # enable_taylorseer false and its order (upstream writes them) leave nothing to run.
        values = {k: v for k, v in settings.items() if k not in ("enable_taylorseer", "taylorseer_order")}
        if values.get("steps_computation_mask") is not None:
            values["steps_computation_mask"] = tuple(values["steps_computation_mask"])
        if "scm_steps_policy" in values:  # upstream vLLM-Omni's name of steps_computation_policy
            values["steps_computation_policy"] = values.pop("scm_steps_policy")
        return cls(**values)

    def warmup_steps(self) -> range:
        """Steps that always compute (cache-dit: a mask's leading 1s bound the warm-up)."""
        warmup = self.max_warmup_steps
        if self.steps_computation_mask is not None:
            leading = next((i for i, m in enumerate(self.steps_computation_mask) if m == 0),
                           len(self.steps_computation_mask))
            warmup = min(warmup, leading)
        return range(0, warmup, self.warmup_interval)


@dataclass
class _RowState:
    step: int = -1  # this row's current step on this transformer
    fn_residual: torch.Tensor | None = None  # the Fn blocks' residual at the last computed step
    residual: torch.Tensor | None = None  # the middle blocks' image residual then
    encoder_residual: torch.Tensor | None = None  # ... and text residual (joint blocks)
    cached_steps: list[int] = field(default_factory=list)
    continuous: int = 0
    diffs: dict[int, float] = field(default_factory=dict)

    def record_cached(self) -> None:
        """cache-dit's count of continuous cached steps (CachedContext.add_cached_step)."""
        if not self.cached_steps:
            self.continuous += 1
        elif self.step - self.cached_steps[-1] == 1:
            self.continuous += 2 if self.continuous == 0 else 1
        self.cached_steps.append(self.step)


State = tuple[torch.Tensor, torch.Tensor | None]  # the blocks' (image, text) streams; text None if not updated
RunRange = Callable[[torch.Tensor | None, State, int, int], State]  # (rows, state, start, end) -> state


class DBCache:
    def __init__(self, config: DBCacheConfig, summary: bool = False,
                 agree: Callable[[list[bool]], list[bool]] | None = None) -> None:
        self.config = config
        self.summary = summary
        # Ranks that run the blocks together (sequence parallelism, HSDP) must reuse the same rows:
        # `agree` returns their leader's decisions (process_group.py); None on a rank of its own.
        self.agree = agree
        self._rows: dict[Hashable, _RowState] = {}
        self._done: dict[str, dict[Hashable, _RowState]] = {}  # rows let go, per request still running
        self.computed = 0  # rows that ran the middle blocks
        self.skipped = 0  # rows that reused their cached residual

    def run(self, keys: Sequence[Hashable], num_blocks: int, state: State, run_range: RunRange) -> torch.Tensor:
        """The blocks' image output for every row of the batch; `keys` name the rows."""
        fn = min(self.config.Fn_compute_blocks, num_blocks)
        bn = min(self.config.Bn_compute_blocks, num_blocks - fn)
        hidden, encoder = run_range(None, state, 0, fn)
        fn_residual = hidden - state[0]
        rows = [self._rows.setdefault(k, _RowState()) for k in keys]
        for row in rows:
            row.step += 1
        reuse = self._decide(rows, fn_residual)
        if self.agree is not None:
            reuse = self.agree(reuse)
        compute = [i for i, r in enumerate(reuse) if not r]
        self.computed += len(compute)
        self.skipped += len(rows) - len(compute)
        out_hidden, out_encoder = hidden.clone(), None if encoder is None else encoder.clone()
        for i, row in enumerate(rows):
            if reuse[i]:
                row.record_cached()
                out_hidden[i] += row.residual
                if out_encoder is not None:
                    out_encoder[i] += row.encoder_residual
        if compute:
            index = torch.tensor(compute, device=hidden.device)
            sub = (hidden[index], None if encoder is None else encoder[index])
            mid_hidden, mid_encoder = run_range(index, sub, fn, num_blocks - bn)
            out_hidden[index] = mid_hidden
            if out_encoder is not None:
                out_encoder[index] = mid_encoder
            for j, i in enumerate(compute):
                rows[i].fn_residual = fn_residual[i].clone()
                rows[i].residual = mid_hidden[j] - sub[0][j]
                rows[i].encoder_residual = None if encoder is None else mid_encoder[j] - sub[1][j]
        if bn:
            out_hidden, out_encoder = run_range(None, (out_hidden, out_encoder), num_blocks - bn, num_blocks)
        return out_hidden

    def _decide(self, rows: list[_RowState], fn_residual: torch.Tensor) -> list[bool]:
        """Per row: reuse the cache? The diffs of all rows that need one are computed together
        (one device-to-host copy per step)."""
        reuse = [False] * len(rows)
        measure = []
        for i, row in enumerate(rows):
            verdict = self._rule(row)
            if verdict is None:
                measure.append(i)
            else:
                reuse[i] = verdict
        measure = [i for i in measure if rows[i].fn_residual is not None
                   and rows[i].fn_residual.shape == fn_residual[i].shape]
        if measure:
            previous = torch.stack([rows[i].fn_residual for i in measure]).flatten(1).float()
            current = fn_residual[measure].flatten(1).float()
            diffs = ((previous - current).abs().mean(1) / previous.abs().mean(1)).tolist()
            for i, diff in zip(measure, diffs):
                rows[i].diffs[rows[i].step] = diff
                reuse[i] = diff < self.config.residual_diff_threshold
        return reuse

    def _rule(self, row: _RowState) -> bool | None:
        """cache-dit's can_cache before the residual diff: True/False decided, None: measure."""
        c = self.config
        if row.residual is None or row.step in c.warmup_steps():
            return False
        if c.steps_computation_mask is not None:
            if row.step < len(c.steps_computation_mask) and c.steps_computation_mask[row.step] == 1:
                return False
            if c.steps_computation_policy == "static":
                return True
        if 0 <= c.max_cached_steps <= len(row.cached_steps):
            return False
        if 0 <= c.max_continuous_cached_steps <= row.continuous:
            row.continuous = 0
            return False
        limit = c.max_accumulated_residual_diff_threshold
        if limit is not None and limit > 0 and sum(d for d in row.diffs.values() if d > 0) >= limit:
            return False
        return None

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Keep the rows `keys` name: (request, branch, image, expert). A request's summary is
        logged once none of its rows is left (finished or aborted)."""
        keep = set(keys)
        for key in [k for k in self._rows if k not in keep]:
            self._done.setdefault(key[0], {})[key] = self._rows.pop(key)
        alive = {k[0] for k in self._rows}
        for request_id in [r for r in self._done if r not in alive]:
            rows = self._done.pop(request_id)
            if self.summary:
                self._log_summary(request_id, rows)

    def _log_summary(self, request_id: str, rows: Mapping[Hashable, _RowState]) -> None:
        """cache-dit's summary table (cached steps, residual diff percentiles), per CFG branch."""
        lines = [f"cache-dit summary, request {request_id}:",
                 "| Branch | Rows | Cache Steps | Diffs P00 | Diffs P25 | Diffs P50 | Diffs P75 | Diffs P95 | "
                 "Diffs Min | Diffs Max |"]
        for uncond, name in ((False, "cond"), (True, "CFG")):
            states = [s for k, s in rows.items() if k[1] == uncond]
            if not states:
                continue
            diffs = [d for s in states for d in s.diffs.values()]
            cached = sum(len(s.cached_steps) for s in states)
            q = [float(np.percentile(diffs, p)) for p in (0, 25, 50, 75, 95)] if diffs else [float("nan")] * 5
            extremes = [min(diffs), max(diffs)] if diffs else [float("nan")] * 2
            lines.append(f"| {name} | {len(states)} | {cached} | " + " | ".join(f"{v:.3f}" for v in (*q, *extremes))
                         + " |")
            for key, state in rows.items():
                if key[1] == uncond:
                    lines.append(f"  row {key}: cached steps {state.cached_steps}")
        logger.info("\n".join(lines))

