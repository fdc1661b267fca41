"""Linear layers, including the fused projections the decoders use.

Checkpoints store q_proj/k_proj/v_proj and gate_proj/up_proj as separate tensors;
we run them as one matmul each. Every parameter carries a `weight_loader(param,
tensor, shard_id)` and the set of `shard_ids` it expects, so a model's
`load_weights` can place HF tensors into fused weights and verify that every shard
of every parameter was filled (see `models/utils.py`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# A parameter's shard set when it is loaded from exactly one checkpoint tensor.
WHOLE = (None,)


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


def row_slice_loader(offsets: dict[Any, tuple[int, int]]) -> Callable:
    """Loader that copies shard `shard_id` into rows [start, start + size) of dim 0."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id not in offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {sorted(map(str, offsets))}")
        start, size = offsets[shard_id]
        target = param.narrow(0, start, size)
        check_shape(f"shard {shard_id!r}", target.shape, loaded)
        with torch.no_grad():
            target.copy_(loaded)

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
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class _StackedLinear(Linear):
    """Linear whose output rows are the concatenation of named shards."""

    def __init__(self, in_features: int, shard_sizes: dict[Any, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        offsets, start = {}, 0
        for shard_id, size in shard_sizes.items():
            offsets[shard_id] = (start, size)
            start += size
        self.shard_sizes = list(shard_sizes.values())
        set_loader(self.weight, row_slice_loader(offsets), offsets)
        if self.bias is not None:
            set_loader(self.bias, row_slice_loader(offsets), offsets)


class QKVLinear(_StackedLinear):
    """One matmul producing q [T, H*D], k and v [T, Hkv*D]; shards "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = F.linear(x, self.weight, self.bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class MergedGateUpLinear(_StackedLinear):
    """One matmul producing [gate | up] (shards 0 and 1), the input of `SiluAndMul`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias)


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
