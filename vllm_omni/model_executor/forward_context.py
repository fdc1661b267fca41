"""Per-step state shared by every attention layer of one forward pass.

The model runner builds one `AttentionMetadata` per step and installs it with
`set_forward_context`; each `Attention` layer reads it. This keeps model code
free of batching details (the nano-vllm / vLLM shape). The context is per thread:
two in-process stages (`runtime.process: false`) step their engines in two threads of
one process, and each forward must see its own step's metadata.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass
class AttentionMetadata:
    # Flat KV-cache slot (block_id * block_size + offset) of every scheduled token. [T]
    slot_mapping: torch.Tensor
    # Cumulative query lengths, [B + 1]; request b owns tokens query_start_loc[b]:query_start_loc[b+1].
    query_start_loc: torch.Tensor
    # KV length of each request after this step (cached + new tokens). [B]
    seq_lens: torch.Tensor
    # KV block ids of each request, right-padded with 0. [B, max_blocks]
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Same lengths as python lists, so backends need no device->host sync.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Built once per step by the attention backend (`AttentionBackend.prepare`).
    backend_state: Any = None


_local = threading.local()


def get_forward_context() -> AttentionMetadata | None:
    return getattr(_local, "meta", None)


@contextlib.contextmanager
def set_forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    previous = get_forward_context()
    _local.meta = meta
    try:
        yield
    finally:
        _local.meta = previous
