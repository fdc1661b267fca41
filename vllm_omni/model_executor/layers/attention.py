"""Attention layer over a paged KV cache, with a portable torch backend.

KV cache layout per layer: key and value tensors of shape
[num_blocks, block_size, num_kv_heads, head_dim]. A token's slot is
block_id * block_size + offset (see `AttentionMetadata.slot_mapping`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.forward_context import AttentionMetadata, get_forward_context
from vllm_omni.model_executor.layers.rotary import apply_rotary_emb


@dataclass
class TorchAttentionState:
    q_batch: torch.Tensor  # [T] request index of each packed query token
    q_pos: torch.Tensor  # [T] position of each query token inside its request's query
    kv_slots: torch.Tensor  # [B, max_seq_len] KV slot of each key position (0 where padded)
    mask: torch.Tensor  # [B, 1, max_query_len, max_seq_len] True where attention is allowed


class TorchAttentionBackend:
    """Reference backend: gathers each request's blocks and runs SDPA with a padded batch.

    Runs on CPU and GPU; it is the correctness reference for faster backends.
    """

    @staticmethod
    def prepare(meta: AttentionMetadata) -> TorchAttentionState:
        device = meta.slot_mapping.device
        num_reqs = len(meta.query_lens_cpu)
        q_lens = torch.tensor(meta.query_lens_cpu, device=device)
        kv_lens = torch.tensor(meta.seq_lens_cpu, device=device)
        q_batch = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens)
        q_pos = torch.arange(q_batch.numel(), device=device) - meta.query_start_loc[:-1].to(device)[q_batch]

        key_pos = torch.arange(meta.max_seq_len, device=device)  # [S]
        block_idx = (key_pos // meta.block_size).clamp(max=meta.block_tables.shape[1] - 1)
        kv_slots = meta.block_tables[:, block_idx] * meta.block_size + key_pos % meta.block_size
        key_valid = key_pos[None, :] < kv_lens[:, None]  # [B, S]
        kv_slots = torch.where(key_valid, kv_slots, torch.zeros_like(kv_slots))

        query_idx = torch.arange(meta.max_query_len, device=device)  # [Q]
        # Query i of request b sits at absolute position kv_len - q_len + i: causal limit.
        limit = (kv_lens - q_lens)[:, None] + query_idx[None, :]  # [B, Q]
        mask = key_valid[:, None, :] & (key_pos[None, None, :] <= limit[:, :, None])
        # Padded query rows attend to key 0 only, so SDPA never sees an empty row (NaN).
        mask[:, :, 0] = True
        return TorchAttentionState(q_batch, q_pos, kv_slots, mask[:, None])

    @staticmethod
    def forward(
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state: TorchAttentionState = meta.backend_state
        num_reqs, num_heads, head_dim = state.kv_slots.shape[0], q.shape[1], q.shape[2]
        q_pad = q.new_zeros(num_reqs, meta.max_query_len, num_heads, head_dim)
        q_pad[state.q_batch, state.q_pos] = q
        num_kv_heads = k_cache.shape[2]
        keys = k_cache.view(-1, num_kv_heads, head_dim)[state.kv_slots]  # [B, S, Hkv, D]
        values = v_cache.view(-1, num_kv_heads, head_dim)[state.kv_slots]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=state.mask,
            scale=scale,
            enable_gqa=num_kv_heads != num_heads,
        )  # [B, H, Q, D]
        return out.transpose(1, 2)[state.q_batch, state.q_pos]


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over the step's paged KV cache.

    Without a forward context (plain `model(...)` call, e.g. in a unit test) it runs
    causal attention over the whole input as one sequence and caches nothing.
    The model runner binds `k_cache` / `v_cache` before the first step.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = TorchAttentionBackend()  # the model runner installs the device's backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]. `rotary` = (cos, sin), each [T, D]:
        rotary embedding applied to q and k here, fused with the KV-cache write on CUDA."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        meta = get_forward_context()
        if meta is not None and self.k_cache is not None and rotary is not None and _fusable(q, k, v):
            from vllm_omni.model_executor.layers import cuda_ops

            cuda_ops.rotary_store_kv(q, k, v, *rotary, self.k_cache, self.v_cache, meta.slot_mapping)
            out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        if rotary is not None:
            q, k = apply_rotary_emb(q, *rotary), apply_rotary_emb(k, *rotary)
        if meta is None or self.k_cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )[0].transpose(0, 1)
        else:
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def _fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The fused CUDA rotary + KV-store kernel needs each row's heads contiguous."""
    return q.is_cuda and all(t.stride(-1) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    if k.is_cuda and k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == k.shape[2] == v.stride(1):
        from vllm_omni.model_executor.layers import cuda_ops

        return cuda_ops.store_kv(k, v, k_cache, v_cache, slots)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
