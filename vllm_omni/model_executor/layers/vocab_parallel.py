"""Token embedding and LM head split by vocabulary rows over the tensor-parallel ranks.

Rank r holds rows [r*s, (r+1)*s) of the table, s = ceil(V / N); the last rank's rows past V
are zero padding. An embedding lookup takes the rows a rank owns and zeros elsewhere, and the
all-reduce adds exactly one non-zero row per token, so the result is bit-identical to the
unsharded table. The LM head gathers each rank's logit columns to rank 0, which samples.
With one rank both are the plain table.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.linear import copy_shard, set_sharded_loader
from vllm_omni.model_executor.parallel_state import current_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = current_tp_group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        rows = -(-num_embeddings // self.tp.size)
        self.vocab_start = min(self.tp.rank * rows, num_embeddings)
        self.vocab_end = min(self.vocab_start + rows, num_embeddings)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        set_sharded_loader(self.weight, self._load)

    def _load(self, param: torch.Tensor, loaded, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"the vocabulary table has no shard {shard_id!r}")
        owned = self.vocab_end - self.vocab_start
        copy_shard(param[:owned], loaded, 0, self.vocab_start, self.num_embeddings, "vocabulary table")
        with torch.no_grad():
            param[owned:].zero_()  # padding rows: never looked up, their logits are dropped

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        elsewhere = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(elsewhere, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill_(elsewhere[..., None], 0)
        return self.tp.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[..., rows] logits of this rank's vocabulary -> [..., V] on rank 0, None on the others."""
        if self.tp.size == 1:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head, sharded like the embedding; used through its weight and `gather_logits`."""
