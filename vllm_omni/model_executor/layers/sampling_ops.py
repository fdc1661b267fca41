"""Triton kernels of sampling (CUDA only): the Sampler's penalties and its rows with small top-ks,
and the code predictors' per-group sampling. Each replaces a dozen or more torch launches with one
and keeps the torch path's rule (and, for the penalties, its bits). Launched like the decode
kernels of `cuda_ops`, under programmatic dependent launch where the GPU has it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_omni.model_executor.layers.cuda_ops import pdl_launch, wait_for_previous_kernel


@triton.jit
def _sample_codes_kernel(logits_ptr, greedy_ptr, gumbel_ptr, out_ptr, vocab, stride_logits, stride_gumbel,
                         inv_temperature, top_k, top_p, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                         VOCAB_PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    ids = tl.arange(0, VOCAB_PAD)
    valid = ids < vocab
    logits = tl.load(logits_ptr + row * stride_logits + ids, mask=valid, other=float("-inf")).to(tl.float32)
    best = tl.argmax(logits, 0, tie_break_left=True)
    scaled = logits * inv_temperature
    if TOP_K or TOP_P:
        ordered = tl.sort(scaled, 0, descending=True)  # the one sort: the nucleus reuses it
    if TOP_K:
        kth = tl.max(tl.where(ids == top_k - 1, ordered, float("-inf")), 0)
        scaled = tl.where(scaled >= kth, scaled, float("-inf"))
        ordered = tl.where(ordered >= kth, ordered, float("-inf"))
    if TOP_P:
        probs = tl.exp(ordered - tl.max(ordered, 0))
        probs = probs / tl.sum(probs, 0)
        above = tl.cumsum(probs, 0) - probs
        last = tl.min(tl.where(above < top_p, ordered, float("inf")), 0)
        scaled = tl.where(scaled >= last, scaled, float("-inf"))
    noise = tl.load(gumbel_ptr + row * stride_gumbel + ids, mask=valid, other=0.0)
    drawn = tl.argmax(scaled + noise, 0, tie_break_left=True)
    code = tl.where(tl.load(greedy_ptr + row) != 0, best, drawn)
    tl.store(out_ptr + row, code.to(tl.int64))


def sample_codes(logits: torch.Tensor, greedy: torch.Tensor, gumbel: torch.Tensor, temperature: float,
                 top_k: int, top_p: float) -> torch.Tensor:
    """`predictor_graphs.sample_codes` in one launch, one program per row: logits [B, V] (rows may be
    strided, any float dtype), greedy [B] bool, gumbel [B, >= V] float32 (rows may be strided).
    The row's argmax, its top-k and nucleus thresholds by an in-register sort, the Gumbel argmax."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    use_top_k = 0 < top_k < vocab
    _sample_codes_kernel[(batch,)](
        logits, greedy, gumbel, out, vocab, logits.stride(0), gumbel.stride(0), 1.0 / temperature,
        top_k if use_top_k else vocab, top_p, TOP_K=use_top_k, TOP_P=top_p < 1.0,
        # 16 warps: the row's sort is a chain of exchange stages, so more threads shorten it (the
        # Qwen3-Omni predictor's 2048 codes, top-k 50: 19 -> 12 us at 1 and at 64 rows, H200).
        VOCAB_PAD=triton.next_power_of_2(vocab), num_warps=16, **pdl_launch(logits.device),
    )
    return out


# The Sampler's kernels run outside the CUDA graphs, on every batch size: arguments that follow
# the batch stay unspecialized, or each new size class (1, a multiple of 16, other) would compile
# another variant in the middle of serving (a compile stalls the stage's step for ~0.1-0.3 s).
@triton.jit(do_not_specialize=["batch"])
def _penalize_kernel(logits_ptr, counts_ptr, seen_ptr, factors_ptr, out_ptr, vocab, batch,
                     REPETITION: tl.constexpr, FREQUENCY_PRESENCE: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < vocab
    offs = row * vocab + v
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0)
    counts = tl.load(counts_ptr + offs, mask=mask, other=0)
    generated = counts > 0
    if REPETITION:
        rep = tl.load(factors_ptr + row)
        seen = tl.load(seen_ptr + offs, mask=mask, other=0) != 0
        penalized = tl.where(logits > 0, tl.math.div_rn(logits, rep), logits * rep)  # torch rounds its division
        logits = tl.where(generated | seen, penalized, logits)
    if FREQUENCY_PRESENCE:
        freq = tl.load(factors_ptr + batch + row)
        pres = tl.load(factors_ptr + 2 * batch + row)
        logits = logits - freq * counts.to(tl.float32) - pres * generated.to(tl.float32)
    tl.store(out_ptr + offs, logits, mask=mask)


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, factors: torch.Tensor,
             repetition: bool, frequency_presence: bool) -> torch.Tensor:
    """The Sampler's penalties in one pass, with its torch ops' arithmetic (the same bits):
    logits [B, V] float32, counts [B, V] int32 (each row's generated tokens), prompt_seen [B, V]
    bool, factors [3, B] float32 (repetition, frequency, presence per row). The repetition
    penalty divides positive logits and multiplies the others of tokens in the prompt or the
    output (transformers' rule); frequency and presence subtract their weight times the count
    and times whether the token was generated."""
    batch, vocab = logits.shape
    logits, counts = logits.contiguous(), counts.contiguous()
    out = torch.empty_like(logits)
    block = 2048
    _penalize_kernel[(batch, triton.cdiv(vocab, block))](
        logits, counts, prompt_seen.contiguous().view(torch.uint8), factors.contiguous(), out, vocab, batch,
        REPETITION=repetition, FREQUENCY_PRESENCE=frequency_presence, BLOCK=block, num_warps=4,
        **pdl_launch(logits.device),
    )
    return out


@triton.jit(do_not_specialize=["fetched", "stride_vals"])
def _top_k_race_kernel(vals_ptr, ids_ptr, noise_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr, fetched,
                       stride_vals, stride_noise, PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    j = tl.arange(0, PAD)
    valid = j < fetched
    # The row's largest logits, descending, scaled like the torch path (a division by the temperature).
    vals = tl.math.div_rn(tl.load(vals_ptr + row * stride_vals + j, mask=valid, other=float("-inf")),
                          tl.load(temperature_ptr + row))
    ids = tl.load(ids_ptr + row * stride_vals + j, mask=valid, other=0)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    top_p = tl.where(top_p < 1.0, top_p, 2.0)  # 1: no nucleus (the mass above never reaches 2)
    kth = tl.max(tl.where(j == k - 1, vals, float("-inf")), 0)
    vals = tl.where(valid & (vals >= kth), vals, float("-inf"))  # ties with the k-th are kept
    exps = tl.exp(vals - tl.max(vals, 0))
    probs = exps / tl.sum(exps, 0)
    # Nucleus: keep a token while the mass ranked above it is below top_p (the top one always).
    above = tl.cumsum(probs, 0) - probs
    vals = tl.where(above < top_p, vals, float("-inf"))
    exps = tl.exp(vals - tl.max(vals, 0))
    probs = exps / tl.sum(exps, 0)
    noise = tl.load(noise_ptr + row * stride_noise + ids, mask=valid, other=1.0)
    pick = tl.argmax(probs / noise, 0, tie_break_left=True)
    tl.store(out_ptr + row, tl.max(tl.where(j == pick, ids, 0), 0).to(tl.int64))


# `top_k_race` fetches this many candidates past the largest top-k, for logits tied with a k-th.
TOP_K_TIE_MARGIN = 8


def top_k_race(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               noise: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """The sampler's random rows when every row has a top-k (<= `max_top_k`): temperature ->
    top-k -> top-p -> the exponential race argmax(p / noise), as `Sampler._sample_random` does it
    over the whole vocabulary, in two launches: `topk` fetches each row's largest logits (sorted),
    one program per row applies the rule to them. logits [B, V] float32; temperature, top_k,
    top_p [B] float32; noise [B, V] (the race's Exp(1) draws, rows may be strided).
    The rule's ties with the k-th logit are kept up to `TOP_K_TIE_MARGIN` past it (more equal
    logits than that at the boundary drop the extra ones)."""
    batch, vocab = logits.shape
    fetched = min(vocab, max_top_k + TOP_K_TIE_MARGIN)
    vals, ids = logits.topk(fetched, dim=-1)
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    _top_k_race_kernel[(batch,)](
        vals, ids, noise, temperature, top_k, top_p, out, fetched, vals.stride(0), noise.stride(0),
        PAD=triton.next_power_of_2(fetched), num_warps=1, **pdl_launch(logits.device),
    )
    return out
