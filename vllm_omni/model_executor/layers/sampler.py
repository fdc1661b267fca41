"""Token sampler with vLLM v1 semantics, vectorized over the batch.

Pipeline for one step (the order matters and follows vLLM v1):

    raw logits --> logprobs (log_softmax of the RAW logits, before anything else)
               --> min_tokens (EOS + stop_token_ids set to -inf)
               --> penalties (repetition over prompt+output, frequency/presence over output)
               --> greedy rows: argmax
                   random rows: temperature -> min_p -> top_k -> top_p -> exponential race

Everything runs on the logits' device. The host builds a few small index / parameter
tensors (copied asynchronously on CUDA) and reads back the result once, at the end.
Work that no request in the batch needs is skipped entirely. On CUDA the penalties are one
kernel (`sampling_ops.penalize`), and random rows whose top-ks are all small take `topk` and one
kernel (`sampling_ops.top_k_race`) instead of sorting or masking the whole vocabulary: the same rule
and the same noise, so the same tokens (tests/gpu/test_cuda_ops.py).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni.model_executor.device_copy import HostCopy, to_device_nowait
from vllm_omni.model_executor.layers.penalty_state import PenaltyState, count_placeholder
from vllm_omni.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# On CUDA, random rows whose top-k are all at most this many take `sampling_ops.top_k_race`.
TOP_K_RACE_MAX = 256


@dataclass
class SamplingBatch:
    """Built by the model runner each step for the requests being sampled (one row each)."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    # Tokens generated BEFORE this step.
    output_token_ids: list[list[int]]
    # A persistent generator owned by the request when params.seed is set (seeded once by the
    # engine, on the logits' device), else None (the row uses the global RNG).
    generators: list[torch.Generator | None]
    # The objects whose outputs the rows continue (the engine's requests): penalty state is kept
    # on the device for them across steps (penalty_state.py). None: rebuilt from the lists.
    owners: list[object] | None = None
    # Async scheduling: a row whose output list ends in PLACEHOLDER_TOKEN (a token sampled by the
    # step before, not read by the host yet) finds its value here, on the device: [1] long.
    placeholder_value: Callable[[int], torch.Tensor] | None = None


class PendingSample:
    """Sampled tokens [B] on the device, and (when rows asked for logprobs) their logprobs, with
    one copy to the host queued behind the sampling: `result()` waits for that copy alone, not
    for work queued after it (the next step's forward, under async scheduling)."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, lp_rows: list[int],
                 params: list[SamplingParams]) -> None:
        self.tokens = tokens
        self._lp_rows, self._params = lp_rows, params
        self._top_n = 0
        flat = tokens
        if raw_logprobs is not None:
            device = tokens.device
            rows = tokens if len(lp_rows) == tokens.shape[0] else tokens[_to_device(lp_rows, torch.long, device)]
            parts = [tokens.double(), raw_logprobs.gather(1, rows.unsqueeze(1)).squeeze(1).double()]
            top_n = max(params[i].logprobs for i in lp_rows)
            if top_n > 0:
                top_lp, top_ids = raw_logprobs.topk(min(top_n, raw_logprobs.shape[1]), dim=-1)
                self._top_n = top_ids.shape[1]
                parts += [top_ids.double().flatten(), top_lp.double().flatten()]
            # float64 holds every token id and float32 logprob exactly: one transfer for all.
            flat = torch.cat(parts)
        self._host = HostCopy(flat)
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> SamplerOutput:
        flat = self._host.get().tolist()
        num_rows = self.tokens.shape[0]
        token_ids = [int(t) for t in flat[:num_rows]]
        logprobs: list[dict[int, float] | None] = [None] * num_rows
        lp_rows, top_n = self._lp_rows, self._top_n
        pos = num_rows
        sampled_lps = flat[pos : pos + len(lp_rows)]
        pos += len(lp_rows)
        top_ids = flat[pos : pos + len(lp_rows) * top_n]
        top_lps = flat[pos + len(lp_rows) * top_n : pos + 2 * len(lp_rows) * top_n]
        for j, i in enumerate(lp_rows):
            entry = {token_ids[i]: sampled_lps[j]}
            for k in range(min(self._params[i].logprobs, top_n)):
                entry.setdefault(int(top_ids[j * top_n + k]), top_lps[j * top_n + k])
            logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # None unless params.logprobs is not None; else {sampled id: lp, top-N ids: lp}.
    logprobs: list[dict[int, float] | None]


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without stalling the host on CUDA (pinned + non_blocking)."""
    return to_device_nowait(torch.tensor(data, dtype=dtype), device)


def _flat_ids(rows_ids: list[list[int]], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of ragged per-row id lists, as two device tensors.

    A flat list instead of a padded [B, L] tensor: no padding work on the host and none
    wasted on the device when lengths differ a lot (long prompts next to short ones).
    Ids outside the logits' vocab (e.g. placeholder ids) cannot be penalized and are dropped.
    """
    lengths = np.fromiter(map(len, rows_ids), dtype=np.int64, count=len(rows_ids))
    # numpy builds these ~3x faster than torch.tensor(list) (long prompts add up).
    flat = np.fromiter(itertools.chain.from_iterable(rows_ids), dtype=np.int64, count=int(lengths.sum()))
    ids = torch.from_numpy(flat)
    rows = torch.from_numpy(np.repeat(np.arange(len(rows_ids), dtype=np.int64), lengths))
    keep = (ids >= 0) & (ids < vocab_size)
    if not bool(keep.all()):  # host-side check on CPU tensors: no device sync
        ids, rows = ids[keep], rows[keep]
    return to_device_nowait(rows, device), to_device_nowait(ids, device)


def _penalty_inputs(batch: SamplingBatch, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(output token counts [B, V] int32, prompt token mask [B, V] bool) from the host lists."""
    num_rows = len(batch.params)
    rows, ids = _flat_ids(batch.output_token_ids, vocab_size, device)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
    for i, out in enumerate(batch.output_token_ids):
        count_placeholder(counts[i], out, batch.placeholder_value, i)
    rows, ids = _flat_ids(batch.prompt_token_ids, vocab_size, device)
    prompt_seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    prompt_seen[rows, ids] = True
    return counts, prompt_seen


class Sampler:
    def __init__(self) -> None:
        self.penalty_state = PenaltyState()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).result()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """The rows' tokens, still on the device (`PendingSample.tokens`); their host copy is
        queued behind the sampling and read by `result()`, so the host may launch more work first."""
        params = batch.params
        num_rows, vocab_size = logits.shape
        assert len(params) == num_rows, f"{len(params)} sampling params for {num_rows} logits rows"
        device = logits.device
        logits = logits.float()

        # 1) Logprobs come from the raw logits (vLLM's default "raw_logprobs" mode).
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            rows = logits if len(lp_rows) == num_rows else logits[_to_device(lp_rows, torch.long, device)]
            raw_logprobs = torch.log_softmax(rows, dim=-1)

        # 2) + 3) Processors that change the argmax: allowed tokens, min_tokens, then penalties.
        logits = self._apply_allowed_tokens(logits, batch)
        logits = self._apply_min_tokens(logits, batch)
        logits, penalty_rows = self._apply_penalties(logits, batch)

        # 4) Greedy and random rows.
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            sampled = logits.argmax(dim=-1)
        elif len(random_rows) == num_rows:
            sampled = self._sample_random(logits, params, batch.generators)
        else:
            sampled = logits.argmax(dim=-1)
            idx = _to_device(random_rows, torch.long, device)
            sub = self._sample_random(
                logits[idx], [params[i] for i in random_rows], [batch.generators[i] for i in random_rows]
            )
            sampled = sampled.index_copy(0, idx, sub)

        if penalty_rows is not None:
            self.penalty_state.record(penalty_rows, sampled)

        # 5) One device -> host transfer for everything the host needs, read when asked for.
        return PendingSample(sampled, raw_logprobs, lp_rows, params)

    # ------------------------------------------------------------------ processors

    @staticmethod
    def _apply_allowed_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """-inf outside each row's allowed_token_ids: every row's ids in one upload and one
        kernel, the 0 a device value (a Python float per row waited for the step's forward each:
        ~7 ms a step at 32 rows of 2048 allowed ids, H200 profile of the Qwen3-Omni talker)."""
        rows = [i for i, p in enumerate(batch.params) if p.allowed_token_ids is not None]
        if not rows:
            return logits
        device = logits.device
        mask_rows, ids = _flat_ids([batch.params[i].allowed_token_ids for i in rows], logits.shape[1], device)
        mask = torch.full((len(rows), logits.shape[1]), _NEG_INF, device=device)
        mask.index_put_((mask_rows, ids), torch.zeros((), device=device))
        logits = logits.clone()
        logits[_to_device(rows, torch.long, device)] += mask
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Until a request has min_tokens outputs, it cannot produce EOS or a stop token id.

        ignore_eos does not mask anything here: it only tells the stop checker not to stop.
        """
        rows: list[int] = []
        ids: list[int] = []
        vocab_size = logits.shape[1]
        for i, (p, out) in enumerate(zip(batch.params, batch.output_token_ids)):
            if len(out) < p.min_tokens:
                banned = {t for t in itertools.chain(p._eos_token_ids, p.stop_token_ids) if 0 <= t < vocab_size}
                rows.extend([i] * len(banned))
                ids.extend(banned)
        if not ids:
            return logits
        logits = logits.clone()  # never modify the caller's tensor
        device = logits.device
        # A device-side value: a Python float would be copied from pageable host memory, which
        # waits for all queued GPU work (the step's forward) before the sampler can go on.
        logits.index_put_((_to_device(rows, torch.long, device), _to_device(ids, torch.long, device)),
                          torch.full((), _NEG_INF, device=device))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Penalized logits, and the penalty state's rows when it was used (to record the sampled tokens)."""
        params = batch.params
        need_rep = any(p.repetition_penalty != 1.0 for p in params)
        need_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        if not (need_rep or need_freq_pres):
            return logits, None
        num_rows, vocab_size = logits.shape
        device = logits.device
        state_rows = None
        if batch.owners is not None and self.penalty_state.fits(num_rows, vocab_size):
            state_rows, counts, prompt_seen = self.penalty_state.gather(
                batch.owners, batch.prompt_token_ids, batch.output_token_ids, vocab_size, device,
                batch.placeholder_value)
        else:
            counts, prompt_seen = _penalty_inputs(batch, vocab_size, device)
        # Rows without a penalty have factor 1 / weight 0: they come out unchanged.
        factors = _to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                              [p.presence_penalty for p in params]], torch.float32, device)
        if logits.is_cuda:  # the same arithmetic in one launch (torch's ops below: ~12)
            from vllm_omni.model_executor.layers import sampling_ops

            return sampling_ops.penalize(logits, counts, prompt_seen, factors, need_rep, need_freq_pres), state_rows
        output_mask = counts > 0
        if need_rep:
            # Repetition penalty over prompt ∪ output, exactly as transformers'
            # RepetitionPenaltyLogitsProcessor: positive logits are divided, others multiplied.
            rep = factors[0].unsqueeze(1)
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(output_mask | prompt_seen, penalized, logits)
        if need_freq_pres:
            freq, pres = factors[1].unsqueeze(1), factors[2].unsqueeze(1)
            logits = logits - freq * counts.float() - pres * output_mask.float()
        return logits, state_rows

    # ------------------------------------------------------------------ random sampling

    @staticmethod
    def _sample_random(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """temperature -> min_p -> top_k -> top_p -> exponential race, for rows that are all random."""
        vocab_size = logits.shape[1]
        device = logits.device
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        # Every row's parameters in one transfer (k < 2^24 is exact in float32).
        temps, min_p, top_p, k = _to_device([[p.temperature for p in params], [p.min_p for p in params],
                                             [p.top_p for p in params], top_k], torch.float32, device).unsqueeze(2)

        max_top_k = max(top_k)
        if (logits.is_cuda and max_top_k <= TOP_K_RACE_MAX and max_top_k < vocab_size
                and not any(p.min_p > 0.0 for p in params)):
            # Every row has a small top-k: the rule over each row's largest logits in one kernel
            # (the torch path below sorts or masks the whole vocabulary: ~25 launches a step).
            from vllm_omni.model_executor.layers import sampling_ops

            noise = _race_noise(torch.empty_like(logits, memory_format=torch.contiguous_format), generators)
            return sampling_ops.top_k_race(logits, temps[:, 0], k[:, 0], top_p[:, 0], noise, max_top_k)

        if any(p.temperature != 1.0 for p in params):
            logits = logits / temps

        if any(p.min_p > 0.0 for p in params):
            # Drop tokens whose probability is below min_p times the most likely token's.
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            logits = logits.masked_fill(probs < threshold, _NEG_INF)

        use_top_k = any(0 < p.top_k < vocab_size for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k and not use_top_p:
            logits = _apply_top_k_only(logits, top_k, k)
        elif use_top_p:
            logits = apply_top_k_top_p(logits, k[:, 0].long() if use_top_k else None, top_p[:, 0])

        probs = logits.softmax(dim=-1)
        return probs.div_(_race_noise(torch.empty_like(probs), generators)).argmax(dim=-1)


def _race_noise(q: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """q [B, V] filled with the exponential race's Exp(1) draws: argmax(p / q) samples exactly
    from p (Gumbel-max in another form) without a cumulative-sum search. A seeded row draws its
    q from its own generator, always V values per step, so its tokens do not depend on the other
    rows."""
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(seeded) < q.shape[0]:
        q.exponential_()
    for i, g in seeded:
        q[i] = torch.empty(q.shape[1], device=q.device).exponential_(generator=g)
    return q


def _apply_top_k_only(logits: torch.Tensor, top_k: list[int], k: torch.Tensor) -> torch.Tensor:
    """Top-k without top-p: a partial topk (k is small) is much cheaper than a full sort.
    `top_k` on the host and `k` [B, 1] (float32) on the device are the same values.

    Same rule as the sort path: keep values >= the row's k-th largest (ties kept).
    """
    vocab_size = logits.shape[1]
    max_k = max(k for k in top_k if k < vocab_size)  # disabled rows must not widen the topk
    top_values = logits.topk(max_k, dim=-1).values
    threshold = top_values.gather(1, (k.long() - 1).clamp(max=max_k - 1))
    # Rows without top-k (k == V) keep everything.
    threshold = threshold.masked_fill(k >= vocab_size, _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside its top-p nucleus, with one sort.

    k: [B] long (V = disabled), p: [B] float (1.0 = disabled). Same algorithm as vLLM: sort
    ascending; top-k keeps values >= the k-th largest (ties at the boundary are kept); top-p
    drops the low tail whose cumulative probability is <= 1 - p, which keeps the smallest
    set of top tokens whose probability reaches p, and always keeps the top token.
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth_largest = logits_sort.gather(1, (logits_sort.shape[1] - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth_largest, _NEG_INF)
    cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)
