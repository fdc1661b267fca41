"""Triton kernels for a mixture-of-experts layer at decode (CUDA only).

At a few tokens the grouped-GEMM path (`moe.moe_forward_grouped`) is ~20 launches a layer:
softmax, a `topk` of 11-15 us on the H200, an argsort, offsets, a row gather, two grouped GEMMs
at ~12 us each (for ~9 MB of expert weights at one token: 20% of the bandwidth) and the slot sums.
Here it is three kernels: the router (softmax, top-k, renormalization; `moe.select_experts` takes
it at every batch size), each routed expert's gate/up product with its SiLU, and the down products
summed over each token's slots (`FusedExperts` takes these two while its pairs route at most
`moe.FEW_ROUTED_BYTES_MAX` of expert weights). They read the expert weights straight through the
expert ids: no sort, no gather, nothing on the host. From there up to `moe.SORTED_TOKEN_MAX`
tokens, where experts are shared by several pairs, `sorted_experts` reads each expert's weights
once for all its pairs.

Numerics follow the grouped path: the router's softmax in float32, its top-k in descending order
(ties: the lower expert id), the renormalization in float32 and one rounding to the model dtype;
each expert's products accumulated in float32 and rounded to the dtype, silu and the product
with up rounded as `silu_and_mul`, each slot's output times its weight rounded, and the slots
summed in float32 with one rounding at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_omni.model_executor.layers.cuda_ops import pdl_launch, wait_for_previous_kernel


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, EXPERTS_PAD: tl.constexpr, SLOTS_PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, EXPERTS_PAD)
    logits = tl.load(logits_ptr + t * stride_logits + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    left = tl.where(e < num_experts, probs / tl.sum(probs, 0), -1.0)
    slots = tl.arange(0, SLOTS_PAD)
    weights = tl.zeros([SLOTS_PAD], tl.float32)
    ids = tl.zeros([SLOTS_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # the largest left, then drop it: descending order
        best = tl.argmax(left, 0, tie_break_left=True)
        weights = tl.where(slots == j, tl.max(left, 0), weights)
        ids = tl.where(slots == j, best, ids)
        left = tl.where(e == best, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    mask = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + t * TOP_K + slots, ids.to(tl.int64), mask=mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.select_experts` in one launch: router_logits [T, E] -> (weights [T, k] in the logits'
    dtype, expert ids [T, k] int64), one program per token."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    _route_kernel[(tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        EXPERTS_PAD=triton.next_power_of_2(num_experts), SLOTS_PAD=max(2, triton.next_power_of_2(top_k)), num_warps=4,
        **pdl_launch(router_logits.device),
    )
    return weights, ids


@triton.jit
def _expert_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, out_ptr, hidden, inter, stride_x,
                           TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)  # (token, slot), token-major
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask = n < inter
    wait_for_previous_kernel(PDL)
    expert = tl.load(ids_ptr + pair)
    gate_rows = w13_ptr + expert * 2 * inter * hidden + n[:, None] * hidden
    up_rows = gate_rows + inter * hidden
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K):
        kk = k0 + k
        k_mask = kk < hidden
        x = tl.load(x_ptr + (pair // TOP_K) * stride_x + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_gate += tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, 1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, 1).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair * inter + n, (silu * up).to(dtype), mask=n_mask)


@triton.jit
def _expert_down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask = n < hidden
    dtype = out_ptr.dtype.element_ty
    wait_for_previous_kernel(PDL)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):  # the token's slots in order
        pair = t * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        rows = w2_ptr + expert * hidden * inter + n[:, None] * inter
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K):
            kk = k0 + k
            k_mask = kk < inter
            h = tl.load(h_ptr + pair * inter + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32) * h
        out = tl.sum(acc, 1).to(dtype).to(tl.float32)
        total += (out * tl.load(weights_ptr + pair).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * hidden + n, total.to(dtype), mask=n_mask)


def few_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """`moe.moe_forward_grouped` for a few tokens in two launches: x [T, H] (rows may be strided),
    w13 [E, 2I, H] and w2 [E, H, I] contiguous, topk_weights/ids [T, k] -> [T, H]."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_launch(x.device)
    # 4 output rows a program, the whole row in 1024-column chunks: the small-row products' shape
    # (cuda_ops.norm_linear), which keeps a few thousand programs streaming at one token.
    block_k = min(1024, triton.next_power_of_2(hidden))
    _expert_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, 4))](
        x, w13, ids, h, hidden, inter, x.stride(0), TOP_K=top_k, BLOCK_N=4, BLOCK_K=block_k, num_warps=4, **pdl,
    )
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _expert_down_kernel[(tokens, triton.cdiv(hidden, 4))](
        h, w2, ids, weights, out, hidden, inter, TOP_K=top_k, BLOCK_N=4,
        BLOCK_K=min(1024, triton.next_power_of_2(inter)), num_warps=4, **pdl,
    )
    return out


@triton.jit(do_not_specialize=["pairs"])
def _sort_pairs_kernel(ids_ptr, order_ptr, starts_ptr, counts_ptr, pairs, num_experts, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    """A counting sort of the (token, slot) pairs by expert, one program per expert: its pairs'
    indices in order at `order[start:start + count]`, start = the pairs of lower experts."""
    expert = tl.program_id(0)
    wait_for_previous_kernel(PDL)
    start = 0
    for p0 in range(0, pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=num_experts)
        start += tl.sum((ids < expert).to(tl.int32))
    count = 0
    for p0 in range(0, pairs, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        mine = tl.load(ids_ptr + p, mask=p < pairs, other=num_experts) == expert
        rank = count + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(order_ptr + start + rank, p, mask=mine)
        count += tl.sum(mine.to(tl.int32))
    tl.store(starts_ptr + expert, start)
    tl.store(counts_ptr + expert, count)


@triton.jit
def _sorted_gate_up_kernel(x_ptr, w13_ptr, order_ptr, starts_ptr, counts_ptr, out_ptr, hidden, inter, stride_x,
                           TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr):
    expert = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask = n < inter
    wait_for_previous_kernel(PDL)
    count = tl.load(counts_ptr + expert)
    start = tl.load(starts_ptr + expert)
    gate_rows = w13_ptr + expert.to(tl.int64) * 2 * inter * hidden + n[:, None] * hidden
    up_rows = gate_rows + inter * hidden
    dtype = out_ptr.dtype.element_ty
    for m0 in range(0, count, BLOCK_M):  # the expert's (token, slot) pairs, BLOCK_M at a time
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < count
        pairs = tl.load(order_ptr + start + m, mask=m_mask, other=0)
        x_rows = x_ptr + (pairs // TOP_K)[:, None] * stride_x
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + k
            k_mask = kk < hidden
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w_gate = tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
            acc_gate = tl.dot(x, tl.trans(w_gate), acc_gate)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + pairs[:, None] * inter + n[None, :], (silu * up).to(dtype),
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sorted_down_kernel(h_ptr, w2_ptr, order_ptr, starts_ptr, counts_ptr, weights_ptr, out_ptr, hidden, inter,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    expert = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask = n < hidden
    wait_for_previous_kernel(PDL)
    count = tl.load(counts_ptr + expert)
    start = tl.load(starts_ptr + expert)
    rows = w2_ptr + expert.to(tl.int64) * hidden * inter + n[:, None] * inter
    dtype = out_ptr.dtype.element_ty
    for m0 in range(0, count, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < count
        pairs = tl.load(order_ptr + start + m, mask=m_mask, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + k
            k_mask = kk < inter
            h = tl.load(h_ptr + pairs[:, None] * inter + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
        weight = tl.load(weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
        out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
        tl.store(out_ptr + pairs[:, None] * hidden + n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def sorted_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, block_m: int = 16, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """`moe.moe_forward_grouped` for tens of tokens: the (token, slot) pairs sorted by expert (a
    counting sort, one program per expert: torch's argsort took 32 us at 384 pairs), then one
    program per (expert, output tile) that reads its expert's weight tile once for all the
    expert's pairs (tensor-core products, BLOCK_M pairs at a time), for the gate/up product with
    its SiLU and for the down product times the slot's weight; the slots summed by torch as the
    grouped path does. No row gather, nothing on the host. x [T, H] (rows may be strided),
    w13 [E, 2I, H] and w2 [E, H, I] contiguous, topk_weights/ids [T, k] -> [T, H]."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, _, inter = w2.shape
    pdl = pdl_launch(x.device)
    pairs = topk_ids.numel()
    order = torch.empty(pairs, dtype=torch.int32, device=x.device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    _sort_pairs_kernel[(num_experts,)](topk_ids.contiguous(), order, starts, counts, pairs, num_experts, BLOCK=256,
                                       num_warps=4, **pdl)
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _sorted_gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, w13, order, starts, counts, h, hidden, inter, x.stride(0), TOP_K=top_k, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )
    per_slot = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _sorted_down_kernel[(num_experts, triton.cdiv(hidden, block_n))](
        h, w2, order, starts, counts, topk_weights.contiguous(), per_slot, hidden, inter, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )
    return per_slot.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
