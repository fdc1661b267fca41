"""CUDA attention backend: FlashAttention (torch varlen) for steps with prefill, and a
Triton paged-decode kernel that reads the block table directly for pure decode steps.

Decode is split over the context ("flash decoding"): each program handles one
(sequence, KV head, context partition) and all query heads of that KV head's group,
then a second kernel merges the partitions. Every launch has a grid fixed by the batch
size and max_model_len, so pure-decode steps can be captured in CUDA graphs. Each sequence
spreads its own context over the partitions (whole tiles each, sized from its length at run
time): a 600-token context under a grid made for 32k still keeps ten programs busy, not one.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn.attention import varlen

from vllm_omni.model_executor.forward_context import AttentionMetadata
from vllm_omni.model_executor.layers.attention import TorchAttentionBackend
from vllm_omni.model_executor.layers.cuda_ops import pdl_launch, wait_for_previous_kernel

# Decode splits a sequence's context into at most this many partitions, one program each, so
# a single sequence still spreads over many SMs; each program walks its partition in
# TILE-token steps (fewer, larger steps: every step waits on a global load).
MAX_PARTITIONS = 32
TILE_TOKENS = 64


def num_partitions_for(max_seq_len: int) -> int:
    return min(MAX_PARTITIONS, triton.cdiv(max_seq_len, TILE_TOKENS))


@triton.jit
def _partition_tokens(seq_len, num_partitions, TILE: tl.constexpr):
    """Tokens per partition of one sequence: whole tiles, as few partitions as cover it."""
    return tl.cdiv(tl.cdiv(seq_len, num_partitions), TILE) * TILE
_VARLEN_HAS_IS_CAUSAL = "is_causal" in inspect.signature(varlen.varlen_attn).parameters


@triton.jit
def _paged_decode_partial(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_q_tok, stride_q_head,
    stride_kv_block, stride_kv_slot, stride_kv_head,
    stride_bt,
    stride_po_tok, stride_po_head, stride_po_part,
    num_partitions,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition = _partition_tokens(seq_len, num_partitions, TILE)
    start = part * partition
    end = tl.minimum(start + partition, seq_len)

    g = tl.arange(0, GROUP_PAD)
    head_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=head_mask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        valid = pos < end
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_off = block_ids[:, None] * stride_kv_block + (pos % BLOCK_SIZE)[:, None] * stride_kv_slot \
            + kv_head * stride_kv_head + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_off = seq * stride_po_tok + heads[:, None] * stride_po_head + part * stride_po_part + d[None, :]
    tl.store(part_out_ptr + out_off, acc, mask=head_mask[:, None])
    stat_off = (seq * tl.num_programs(1) * GROUP + heads) * num_partitions + part
    tl.store(part_max_ptr + stat_off, m_i, mask=head_mask)
    tl.store(part_sum_ptr + stat_off, l_i, mask=head_mask)


@triton.jit
def _paged_decode_merge(
    part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, out_ptr,
    stride_po_tok, stride_po_head, stride_po_part, stride_o_tok, stride_o_head,
    num_heads, num_partitions,
    TILE: tl.constexpr, PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, _partition_tokens(seq_len, num_partitions, TILE))
    parts = tl.arange(0, PARTS_PAD)
    valid = parts < used
    stat_off = (seq * num_heads + head) * num_partitions + parts
    m = tl.load(part_max_ptr + stat_off, mask=valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + stat_off, mask=valid, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(valid, tl.exp(m - m_max), 0.0)
    denom = tl.sum(w * l, 0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_out_ptr + seq * stride_po_tok + head * stride_po_head + parts[:, None] * stride_po_part
                  + d[None, :], mask=valid[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    max_seq_len: int,  # bound used for the grid (max_model_len under CUDA graphs)
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_partitions = num_partitions_for(max_seq_len)
    part_out = torch.empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _paged_decode_partial[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        num_partitions,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        TILE=TILE_TOKENS, num_warps=4,
        # float32 caches are for exactness checks: keep full precision instead of TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **pdl_launch(q.device),
    )
    out = torch.empty_like(q)
    _paged_decode_merge[(num_seqs, num_heads)](
        part_out, part_max, part_sum, seq_lens, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), out.stride(0), out.stride(1),
        num_heads, num_partitions,
        TILE=TILE_TOKENS, PARTS_PAD=max(2, triton.next_power_of_2(num_partitions)), HEAD_DIM=head_dim,
        **pdl_launch(q.device),
    )
    return out


@dataclass
class TritonAttentionState:
    decode_only: bool
    # Prefill path: the KV of every request gathered in order, for FlashAttention varlen.
    kv_gather_slots: torch.Tensor | None = None  # [sum(seq_lens)]
    cu_seq_k: torch.Tensor | None = None  # [B + 1] int32
    cu_seq_q: torch.Tensor | None = None  # [B + 1] int32
    # Decode path: grid bound (max_model_len when captured in a CUDA graph).
    grid_max_seq_len: int = 0
    # Prefill in float32 (no FlashAttention kernel for it): the torch reference path.
    torch_state: object | None = None


class TritonAttentionBackend:
    def __init__(self, dtype: torch.dtype) -> None:
        self.use_flash = dtype in (torch.float16, torch.bfloat16)

    def prepare(self, meta: AttentionMetadata, grid_max_seq_len: int | None = None) -> TritonAttentionState:
        if meta.max_query_len == 1:
            return TritonAttentionState(decode_only=True, grid_max_seq_len=grid_max_seq_len or meta.max_seq_len)
        if not self.use_flash:
            return TritonAttentionState(decode_only=False, torch_state=TorchAttentionBackend.prepare(meta))
        device = meta.slot_mapping.device
        seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)
        cu_seq_k = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu_seq_k[1:] = torch.cumsum(seq_lens, 0)
        bs = meta.block_size
        slots = []
        for i, n in enumerate(meta.seq_lens_cpu):
            pos = torch.arange(n, device=device)
            slots.append(meta.block_tables[i, pos // bs] * bs + pos % bs)
        return TritonAttentionState(
            decode_only=False,
            kv_gather_slots=torch.cat(slots),
            cu_seq_k=cu_seq_k.to(device, non_blocking=True),
            cu_seq_q=meta.query_start_loc.to(torch.int32),
        )

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        state: TritonAttentionState = meta.backend_state
        if state.decode_only:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          state.grid_max_seq_len)
        if state.torch_state is not None:
            meta.backend_state = state.torch_state
            try:
                return TorchAttentionBackend.forward(q, k_cache, v_cache, meta, scale)
            finally:
                meta.backend_state = state
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.view(-1, num_kv_heads, head_dim)[state.kv_gather_slots]
        values = v_cache.view(-1, num_kv_heads, head_dim)[state.kv_gather_slots]
        # Causal masking in FlashAttention aligns the query block to the end of the keys,
        # which is exactly "new tokens after a cached prefix".
        causal = {"is_causal": True} if _VARLEN_HAS_IS_CAUSAL else {"window_size": (-1, 0)}
        return varlen.varlen_attn(q, keys, values, state.cu_seq_q, state.cu_seq_k,
                                  meta.max_query_len, meta.max_seq_len, scale=scale, **causal)
