"""CUDA graphs for the prefill spans of a step, one per token-count bucket.

A talker's first step is its prompt's prefill: at one request in flight, 28 eager layers cost
~25 ms of host work for ~2 ms of GPU work on the H200 (docs/benchmarks.md), and that is most
of the time to first audio. Here the spans [start, end) of up to MAX_SPANS requests run packed
as one captured graph of the whole forward, padded to the bucket that holds their keys (the
sum of their `end`s):

- queries: the spans' rows one after another, padded at the end; padded rows write their KV
  into the scratch block and their outputs are dropped. Rows are independent in every op but
  attention, and there FlashAttention varlen reads the spans' lengths from device buffers
  (cu_seqlens of queries and of keys, MAX_SPANS + 1 entries, unused spans empty at the end), so
  a padded row is never a key;
- keys: gathered from the KV cache by slot (each request's blocks for positions < its end);
- max_seqlen_q / max_seqlen_k: the bucket (an upper bound is what FlashAttention needs);
- logits of each span's last row only (the one a completed prompt samples from).

Several spans in one step are requests arriving together: before, any step with two of them
ran eagerly, its decode rows too. Graphs exist only where the prefill runs on FlashAttention
(bfloat16 / float16); float32 prefills take the torch reference path, which builds masks from
host-side lengths. A decode step with prefills alongside (requests arriving under load) replays
the decode graph and a prefill graph in one step (model_runner.py).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from vllm_omni.model_executor.device_copy import PinnedStaging
from vllm_omni.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm_omni.model_executor.graph_capture import capture_buckets
from vllm_omni.model_executor.layers.triton_attention import TritonAttentionState

logger = logging.getLogger(__name__)

_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
# Rows of the int64 input buffer: ids, KV write slots, KV read slots, lengths, positions (1 or 3).
_IDS, _SLOTS, _KV_SLOTS, _LENGTHS, _POSITIONS = 0, 1, 2, 3, 4
MAX_SPANS = 4  # spans per graph: the lengths row below fits the smallest bucket (3 * 4 + 2 <= 16)
# Columns of the lengths row: query cu_seqlens, key cu_seqlens, each span's last row.
_CU_Q, _CU_K, _LAST = (slice(0, MAX_SPANS + 1), slice(MAX_SPANS + 1, 2 * MAX_SPANS + 2),
                       slice(2 * MAX_SPANS + 2, 3 * MAX_SPANS + 2))


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Buckets up to the first that holds `max_tokens` (the step token budget or the model length)."""
    sizes = []
    for size in _BUCKETS:
        sizes.append(size)
        if size >= max_tokens:
            break
    return sizes


class PrefillGraphs:
    max_spans = MAX_SPANS

    def __init__(self, model: nn.Module, *, device: torch.device, max_tokens: int, block_size: int,
                 scratch_block: int, mrope: bool, embeds: bool, capture_layers: tuple[int, ...]) -> None:
        self.model = model
        self.sizes = prefill_capture_sizes(max_tokens)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.capture_layers = capture_layers
        self.mrope = mrope
        n = self.sizes[-1]
        # One buffer (one host-to-device copy per step) for every per-token input.
        self.token_rows = torch.zeros(_POSITIONS + (3 if mrope else 1), n, dtype=torch.long, device=device)
        self.staging = PinnedStaging(tuple(self.token_rows.shape), torch.long)
        dtype = next(model.parameters()).dtype
        self.inputs_embeds = torch.zeros(n, model.hidden_size, dtype=dtype, device=device) if embeds else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]] = {}

    def bucket(self, end: int) -> int | None:
        """The graph for a span ending at token `end`, or None when the span is too long."""
        return next((s for s in self.sizes if s >= end), None)

    def _run(self, size: int):
        rows = self.token_rows
        lengths = rows[_LENGTHS]
        meta = AttentionMetadata(  # seq_lens: not read by the prefill path (FlashAttention reads cu_seq_k)
            slot_mapping=rows[_SLOTS, :size], query_start_loc=lengths[_CU_Q], seq_lens=lengths[_CU_K][1:],
            block_tables=lengths[None, :0],  # unused: the prefill path reads its keys by kv_gather_slots
            block_size=self.block_size, max_query_len=size, max_seq_len=size,
            query_lens_cpu=[size], seq_lens_cpu=[size])
        meta.backend_state = TritonAttentionState(
            decode_only=False, kv_gather_slots=rows[_KV_SLOTS, :size],
            cu_seq_q=lengths[_CU_Q].to(torch.int32), cu_seq_k=lengths[_CU_K].to(torch.int32))
        positions = rows[_POSITIONS:, :size] if self.mrope else rows[_POSITIONS, :size]
        embeds = self.inputs_embeds[:size] if self.inputs_embeds is not None else None
        with set_forward_context(meta):
            hidden, captured = self.model(rows[_IDS, :size], positions, inputs_embeds=embeds,
                                          capture_layers=self.capture_layers)
        return hidden, self.model.compute_logits(hidden[lengths[_LAST]]), captured

    def capture(self) -> None:
        staging_t, staging = self.staging.next()
        staging[:] = 0
        staging[_SLOTS] = staging[_KV_SLOTS] = self.scratch_slot

        def whole_bucket(size: int) -> None:  # one span filling the bucket, on the scratch block
            staging[_LENGTHS, _CU_Q] = staging[_LENGTHS, _CU_K] = [0] + [size] * MAX_SPANS
            staging[_LENGTHS, _LAST] = size - 1
            self.token_rows.copy_(staging_t)

        self.graphs, self.outputs = capture_buckets(self.sizes, self._run, before=whole_bucket)
        logger.info("captured prefill CUDA graphs for spans of up to %s tokens", self.sizes)

    def stage(self, spans: list[tuple[list[int], object, list[int], list[int]]]) -> torch.Tensor:
        """Copy the spans' inputs into the static buffers (queued, no wait), packed in order. A span
        is (its ids, positions ([n] or [3, n] integers), KV write slots [n], the request's KV read
        slots [end]: its cached prefix, then the span). Returns the spans' ids on the device."""
        ends = [len(kv_slots) for _, _, _, kv_slots in spans]
        size = self.bucket(sum(ends))
        staging_t, staging = self.staging.next()
        staging[:, :size] = 0  # padding: id 0 at position 0, written to and read from the scratch block
        staging[_SLOTS, :size] = staging[_KV_SLOTS, :size] = self.scratch_slot
        q = k = 0
        cu_q, cu_k, last = [0], [0], []
        for (input_ids, positions, slots, kv_slots), end in zip(spans, ends):
            n = len(input_ids)
            staging[_IDS, q:q + n] = input_ids
            staging[_SLOTS, q:q + n] = slots
            staging[_POSITIONS:, q:q + n] = positions
            staging[_KV_SLOTS, k:k + end] = kv_slots
            q, k = q + n, k + end
            cu_q.append(q)
            cu_k.append(k)
            last.append(q - 1)
        unused = MAX_SPANS - len(spans)
        staging[_LENGTHS, _CU_Q] = cu_q + [q] * unused
        staging[_LENGTHS, _CU_K] = cu_k + [k] * unused
        staging[_LENGTHS, _LAST] = last + [0] * unused
        self.token_rows[:, :size].copy_(staging_t[:, :size], non_blocking=True)
        self.staging.queued()
        return self.token_rows[_IDS, :q]

    def replay(self, spans: int, rows: int, keys: int, inputs_embeds: torch.Tensor | None):
        """The staged spans (`rows` query rows, `keys` keys in all): (hidden [rows, H], logits
        [spans, V] of each span's last row, captured layers [rows, H]). The outputs are the graph's
        own buffers: the next replay overwrites them."""
        size = self.bucket(keys)
        if self.inputs_embeds is not None:
            self.inputs_embeds[:rows].copy_(inputs_embeds)
        self.graphs[size].replay()
        hidden, logits, captured = self.outputs[size]
        return hidden[:rows], logits[:spans], {k: v[:rows] for k, v in captured.items()}
