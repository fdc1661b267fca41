"""Linear layers, including the fused projections the decoders use.

Checkpoints store q_proj/k_proj/v_proj and gate_proj/up_proj as separate tensors;
we run them as one matmul each. Every parameter carries a `weight_loader(param,
tensor, shard_id)` and the set of `shard_ids` it expects, so a model's
`load_weights` can place HF tensors into fused weights and verify that every shard
of every parameter was filled (see `models/utils.py`).

Tensor parallelism (Megatron layout): the fused projections are column-parallel (each rank
computes its heads of q/k/v and its slice of gate/up), `RowParallelLinear` consumes such a
slice and sums the ranks' partial outputs. A layer shards over the group current while it is
built (`parallel_state.building_with`); with one rank it is the plain layer. Their loaders copy
this rank's rows (or columns) of the checkpoint tensor and read only those from a
`CheckpointSlice`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.checkpoint_slice import DummyCheckpointTensor
from vllm_omni.model_executor.parallel_state import current_tp_group

# A parameter's shard set when it is loaded from exactly one checkpoint tensor.
WHOLE = (None,)

# `cuda_ops.small_m_linear` takes x @ W^T for decode rows up to this many and weights up to this
# size in each dimension: there cuBLAS's kernels are latency-bound (4-13 us for a 1-4 MB weight on
# the H200, 8-38% of the HBM bandwidth), ours take 3.7-5 us; for larger weights or more rows
# cuBLAS is as fast or faster (docs/benchmarks.md, round 13).
SMALL_M_ROWS = 2
SMALL_M_MAX_DIM = 4096
# Longer rows (K > SMALL_M_MAX_DIM: the down products) for weights of at most this many rows:
# the Qwen2.5 talker's down product 11.0 / 11.5 us at 1 / 2 rows against cuBLAS's 13.5 / 13.6, the
# TTS talker's (2048 rows) 8.8 / 10.4 against 11.2 / 10.8; the 7B thinker's (3584 rows) loses at 2
# rows (40.1 against 38.1; benchmarks/bench_small_linear.py, docs/benchmarks.md round 17).
SMALL_M_LONG_ROWS_MAX_N = 2048


# `cuda_ops.norm_linear` (an RMSNorm fused into the product after it) for as many decode rows and
# weights of at most this many input columns (one chunk of the row per program) and output rows:
# there it beats the norm, product and gated activation launched apart by 1.0-2.6 us a layer
# (the code predictors' and talkers' q/k/v and gate/up products); on the Qwen2.5 talker's 37888-row
# gate/up and the 7B thinker's products it loses (benchmarks/bench_norm_linear.py, round 16).
NORM_FUSED_MAX_K = 1024
NORM_FUSED_MAX_N = 8192


def fuses_norm(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `RMSNorm.then_linear` runs the norm inside this product (`cuda_ops.norm_linear`)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= SMALL_M_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == norm_weight.dtype == x.dtype and weight.shape[1] <= NORM_FUSED_MAX_K
            and weight.shape[0] <= NORM_FUSED_MAX_N and x.stride(-1) == 1 and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; on CUDA in half precision, small decode-time products through our kernel."""
    if (x.is_cuda and x.dim() == 2 and x.shape[0] <= SMALL_M_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.shape[0] <= SMALL_M_MAX_DIM and x.stride(-1) == 1
            and (weight.shape[1] <= SMALL_M_MAX_DIM or weight.shape[0] <= SMALL_M_LONG_ROWS_MAX_N)
            and weight.is_contiguous()):
        from vllm_omni.model_executor.layers import cuda_ops

        return cuda_ops.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def check_shape(param_name: str, expected: Sequence[int], loaded: torch.Tensor) -> None:
    if tuple(expected) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch loading {param_name}: parameter slice {tuple(expected)}, "
            f"checkpoint tensor {tuple(loaded.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    check_shape("parameter", param.shape, loaded)
    with torch.no_grad():
        param.copy_(loaded)  # copy_ casts dtype and moves device in one step


def set_loader(param: nn.Parameter, loader: Callable, shard_ids: Sequence[Any] = WHOLE) -> None:
    param.weight_loader = loader
    param.shard_ids = frozenset(shard_ids)


def set_sharded_loader(param: nn.Parameter, loader: Callable, shard_ids: Sequence[Any] = WHOLE) -> None:
    """A loader built on `copy_shard`: it may be handed a `CheckpointSlice` and read only its part."""
    set_loader(param, loader, shard_ids)
    param.reads_slices = True


def copy_shard(target: torch.Tensor, loaded, dim: int, src_start: int, src_total: int, what: str) -> None:
    """target <- loaded[src_start : src_start + target.shape[dim]] along `dim`.

    `loaded` is the whole checkpoint tensor (or a `CheckpointSlice` of it): its shape must be
    target's with `src_total` at `dim`, so a checkpoint of the wrong size never half-loads.
    """
    expected = list(target.shape)
    expected[dim] = src_total
    if isinstance(loaded, DummyCheckpointTensor):
        loaded = loaded.materialize(expected, target)
    check_shape(what, expected, loaded)
    with torch.no_grad():
        target.copy_(loaded.narrow(dim, src_start, target.shape[dim]))


def column_slice_loader(start: int, total: int) -> Callable:
    """Loader of a row-parallel weight: this rank's columns [start, start + local) of `total`."""

    def load(param: torch.Tensor, loaded, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
        copy_shard(param, loaded, 1, start, total, "row-parallel weight")

    return load


@dataclass(frozen=True)
class ShardRows:
    """Rows [dst_start, dst_start + size) of a stacked parameter hold rows
    [src_start, src_start + size) of a checkpoint tensor with `src_total` rows."""

    dst_start: int
    size: int
    src_start: int
    src_total: int


def row_slice_loader(shards: dict[Any, ShardRows]) -> Callable:
    """Loader that copies this rank's rows of shard `shard_id` into its place along dim 0."""

    def load(param: torch.Tensor, loaded, shard_id: Any = None) -> None:
        if shard_id not in shards:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {sorted(map(str, shards))}")
        rows = shards[shard_id]
        copy_shard(param.narrow(0, rows.dst_start, rows.size), loaded, 0, rows.src_start, rows.src_total,
                   f"shard {shard_id!r}")

    return load


class Linear(nn.Module):
    """y = x W^T (+ b), loaded from one checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_loader(self.weight, default_weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_loader(self.bias, default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class _StackedLinear(Linear):
    """Column-parallel linear whose output rows are this rank's rows of named shards, concatenated.

    `shards`: shard id -> (rows this rank holds, first checkpoint row, checkpoint rows).
    """

    def __init__(self, in_features: int, shards: dict[Any, tuple[int, int, int]], bias: bool):
        super().__init__(in_features, sum(size for size, _, _ in shards.values()), bias)
        placed, dst = {}, 0
        for shard_id, (size, src_start, src_total) in shards.items():
            placed[shard_id] = ShardRows(dst, size, src_start, src_total)
            dst += size
        self.shard_sizes = [rows.size for rows in placed.values()]
        set_sharded_loader(self.weight, row_slice_loader(placed), placed)
        if self.bias is not None:
            set_sharded_loader(self.bias, row_slice_loader(placed), placed)


class QKVLinear(_StackedLinear):
    """One matmul producing q [T, H*D], k and v [T, Hkv*D]; shards "q", "k", "v".

    Over N ranks each holds H/N query heads and Hkv/N KV heads; with fewer KV heads than ranks
    each KV head is replicated on N/Hkv ranks (as vLLM does), the one its query heads share.
    `num_heads` / `num_kv_heads` are this rank's counts.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = current_tp_group()
        q_start, self.num_heads = tp.shard_range(num_heads, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        kv = (self.kv_size, kv_start * head_dim, num_kv_heads * head_dim)
        shards = {"q": (self.q_size, q_start * head_dim, num_heads * head_dim), "k": kv, "v": kv}
        super().__init__(hidden_size, shards, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split(linear(x, self.weight, self.bias))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The product's output [T, (H + 2 Hkv) D] as views q, k, v."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, KV heads) of `rank`: an equal share, or one replicated head when
    there are fewer KV heads than ranks."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide num_key_value_heads={num_kv_heads}")
        return rank * (num_kv_heads // size), num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} < tensor_parallel_size={size} must divide it "
                         "(each KV head is replicated on tensor_parallel_size / num_key_value_heads ranks)")
    return rank * num_kv_heads // size, 1


class MergedGateUpLinear(_StackedLinear):
    """One matmul producing [gate | up] (shards 0 and 1), the input of `SiluAndMul`; each rank
    holds its 1/N of both."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        start, size = current_tp_group().shard_range(intermediate_size, "intermediate_size")
        half = (size, start, intermediate_size)
        super().__init__(hidden_size, {0: half, 1: half}, bias)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (+ b): each rank holds its 1/N of the input columns and
    consumes the matching slice of x (a column-parallel layer's output); the bias is added
    once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = current_tp_group()
        start, size = self.tp.shard_range(in_features, "the row-parallel input size")
        super().__init__(size, out_features, bias)
        set_sharded_loader(self.weight, column_slice_loader(start, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding table [V, H]; lives here because a tied lm_head reuses its weight as a Linear's.

    Unlike nn.Embedding it does not random-initialize a table that loading overwrites anyway.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        set_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
