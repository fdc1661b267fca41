"""Per-request penalty state kept on the device across steps (the sampler's persistent batch).

Repetition, frequency and presence penalties need, per row, the counts of the tokens the
request generated and the set of its prompt tokens. Rebuilt from the host lists every step,
that is host work proportional to everything generated so far (a 500-code talker reply at
batch 32 is 16k ids a step). Here each request owns a row of two device buffers, built once
from its lists and then updated on the device with each sampled token, so a step costs one
gather, whatever the lengths.

A row is keyed by the request object (weakly: a finished request frees nothing by hand) and
trusted only while the number of outputs it has counted equals the request's output count;
anything else (a recompute that changed the outputs, a row lent to another request meanwhile)
rebuilds it from the lists. When every row is taken, the least recently used row that the
current batch does not need is lent out; only a batch larger than all rows grows the buffers,
and never past MAX_BYTES (memory the KV-cache sizing does not see): a batch that would need
more is penalized from the lists (`fits`).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni.model_executor.device_copy import to_device_nowait
from vllm_omni.sampling_params import PLACEHOLDER_TOKEN


MAX_BYTES = 256 << 20
_BYTES_PER_TOKEN = 5  # an int32 count and a bool per vocabulary entry and row


@dataclass
class _Row:
    index: int
    ticket: int  # which lending of the row this is: a row lent to another request is stale


class PenaltyState:
    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [rows, V] int32: output token counts
        self.prompt_seen: torch.Tensor | None = None  # [rows, V] bool: prompt tokens
        self._rows: weakref.WeakKeyDictionary[object, _Row] = weakref.WeakKeyDictionary()
        self._ticket: list[int] = []  # per row: the ticket of its current lending
        self._counted: list[int] = []  # per row: outputs counted so far
        self._last_used: list[int] = []  # per row: the step that last used it
        self._step = 0
        self._next_ticket = 0
        self._gathered: list[int] = []  # rows of the last gather, in batch order
        self.builds = 0  # rows built from the lists (a debugging and test aid)

    def fits(self, batch: int, vocab_size: int) -> bool:
        """Whether the rows for a batch of this size stay within MAX_BYTES."""
        return _grown_size(self._size(vocab_size), batch) * vocab_size * _BYTES_PER_TOKEN <= MAX_BYTES

    def _size(self, vocab_size: int) -> int:
        return 0 if self.counts is None or self.counts.shape[1] != vocab_size else self.counts.shape[0]

    def gather(self, owners: list[object], prompts: list[list[int]], outputs: list[list[int]],
               vocab_size: int, device: torch.device, placeholder_value: Callable[[int], torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row indices [B] on the device, output counts [B, V] int32, prompt mask [B, V] bool).
        An output list may end in a placeholder (SamplingBatch.placeholder_value has its value)."""
        self._step += 1
        self._ensure(vocab_size, device, len(owners))
        indices = []
        in_batch: set[int] = set()
        for i, (owner, prompt, output) in enumerate(zip(owners, prompts, outputs)):
            row = self._rows.get(owner)
            if row is None or self._ticket[row.index] != row.ticket or self._counted[row.index] != len(output):
                row = self._lend(owner, in_batch)
                self._build(row.index, prompt, output, vocab_size, device)
                count_placeholder(self.counts[row.index], output, placeholder_value, i)
            self._last_used[row.index] = self._step
            in_batch.add(row.index)
            indices.append(row.index)
        self._gathered = indices
        index = to_device_nowait(torch.tensor(indices, dtype=torch.long), device)
        return index, self.counts[index], self.prompt_seen[index]

    def record(self, index: torch.Tensor, sampled: torch.Tensor) -> None:
        """Count each gathered row's sampled token, on the device (the engine appends it to the
        request's outputs after the step, which is what the next gather checks)."""
        # One token per row and rows distinct: an index_add on the flat buffer (index_put_ with
        # accumulate sorts its indices first, and costs ~10x the launch time on CUDA).
        flat = index * self.counts.shape[1] + sampled
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        for i in self._gathered:
            self._counted[i] += 1

    def _ensure(self, vocab_size: int, device: torch.device, batch: int) -> None:
        if self.counts is not None and (self.counts.shape[1] != vocab_size or self.counts.device != device):
            self.counts = self.prompt_seen = None  # another vocabulary or device: start over
            self._rows.clear()
            self._ticket, self._counted, self._last_used = [], [], []
        size = self._size(vocab_size)
        new_size = _grown_size(size, batch)
        if new_size == size:
            return
        counts = torch.zeros(new_size, vocab_size, dtype=torch.int32, device=device)
        seen = torch.zeros(new_size, vocab_size, dtype=torch.bool, device=device)
        if self.counts is not None:
            counts[:size] = self.counts
            seen[:size] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        grow = new_size - size
        self._ticket += [-1] * grow
        self._counted += [0] * grow
        self._last_used += [0] * grow

    def _lend(self, owner: object, in_batch: set[int]) -> _Row:
        free = [i for i in range(len(self._ticket)) if i not in in_batch]
        index = min(free, key=lambda i: self._last_used[i])  # never used rows have last_used 0
        self._next_ticket += 1
        self._ticket[index] = self._next_ticket
        row = self._rows[owner] = _Row(index, self._next_ticket)
        return row

    def _build(self, index: int, prompt: list[int], output: list[int], vocab_size: int, device: torch.device) -> None:
        self.builds += 1
        self.counts[index].zero_()
        self.prompt_seen[index].zero_()
        out = _in_vocab(output, vocab_size)
        if out.numel():
            self.counts[index].index_put_((to_device_nowait(out, device),),
                                          torch.ones(out.numel(), dtype=torch.int32, device=device), accumulate=True)
        ids = _in_vocab(prompt, vocab_size)
        if ids.numel():  # a new request's row, built between a step's launches: nothing waits for the GPU
            self.prompt_seen[index].index_fill_(0, to_device_nowait(ids, device), True)
        self._counted[index] = len(output)


def _grown_size(size: int, batch: int) -> int:
    return size if size >= batch else max(batch, 2 * size, 8)


def _in_vocab(ids: list[int], vocab_size: int) -> torch.Tensor:
    """Ids outside the logits' vocabulary (placeholders) cannot be penalized: dropped."""
    flat = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    return flat[(flat >= 0) & (flat < vocab_size)]


def count_placeholder(counts: torch.Tensor, output: list[int], placeholder_value: Callable[[int], torch.Tensor] | None,
                      row: int) -> None:
    """When `output` ends in a placeholder (out of vocabulary, so no list count sees it), count
    its token into `counts` [V] from the device (`placeholder_value(row)`)."""
    if output and output[-1] == PLACEHOLDER_TOKEN:
        counts.index_add_(0, placeholder_value(row), torch.ones(1, dtype=torch.int32, device=counts.device))
