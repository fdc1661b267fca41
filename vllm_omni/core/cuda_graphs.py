"""CUDA graphs for pure-decode steps, one per batch-size bucket.

A decode step of a large model at small batch is dominated by kernel launch gaps;
replaying a captured graph removes them. Inputs live in static buffers sized for the
largest bucket; a batch is padded up to the next bucket, and padded rows write their
KV into a scratch block that no request owns.
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

_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        mrope: bool,
        embeds: bool,
        capture_layers: tuple[int, ...],
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture_layers = capture_layers
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        # Per-token inputs in one [rows, n] buffer so a step needs one host-to-device copy:
        # row 0 ids, 1 slots, 2 KV lengths, 3 (or 3..5 for M-RoPE) positions.
        self.mrope = mrope
        self.token_rows = torch.zeros(6 if mrope else 4, n, dtype=torch.long, device=device)
        self.staging = PinnedStaging(tuple(self.token_rows.shape), torch.long)
        self.input_ids, self.slot_mapping, self.seq_lens = self.token_rows[0], self.token_rows[1], self.token_rows[2]
        self.positions = self.token_rows[3:6] if mrope else self.token_rows[3]
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.block_staging = PinnedStaging(tuple(self.block_tables.shape), torch.long)
        dtype = next(model.parameters()).dtype
        self.inputs_embeds = torch.zeros(n, model.hidden_size, dtype=dtype, device=device) if embeds else None
        self.query_start_loc = torch.arange(n + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[1] * b,
        )
        meta.backend_state = TritonAttentionState(decode_only=True, grid_max_seq_len=self.max_model_len)
        return meta

    def _run(self, b: int):
        embeds = self.inputs_embeds[:b] if self.inputs_embeds is not None else None
        with set_forward_context(self._meta(b)):
            hidden, captured = self.model(self.input_ids[:b], self.positions[..., :b], inputs_embeds=embeds,
                                          capture_layers=self.capture_layers)
        return hidden, self.model.compute_logits(hidden), captured

    @torch.inference_mode()
    def capture(self) -> None:
        self.slot_mapping.fill_(self.scratch_block * self.block_size)
        self.seq_lens.fill_(1)
        self.block_tables.fill_(self.scratch_block)
        self.graphs, self.outputs = capture_buckets(self.sizes, self._run)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def stage_inputs(
        self,
        input_ids: list[int],
        positions: list[int] | list[tuple[int, int, int]],  # M-RoPE: (t, h, w) per row
        slot_mapping: list[int],
        block_rows: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Copy a real batch b's per-token inputs into the static buffers (padded to its bucket:
        padded rows read and write only the scratch block), in two host-to-device copies queued
        without waiting. Returns the batch's input ids on the device (for models that embed their
        own rows before `replay`)."""
        b = len(input_ids)
        size = self._bucket(b)
        staging_t, staging = self.staging.next()
        staging[:, b:size] = 0
        staging[1, b:size] = self.scratch_block * self.block_size
        staging[2, b:size] = 1
        staging[0, :b] = input_ids
        staging[1, :b] = slot_mapping
        staging[2, :b] = seq_lens
        if self.mrope:
            staging[3:6, :b] = list(zip(*positions))
        else:
            staging[3, :b] = positions
        blocks_t, blocks = self.block_staging.next()
        blocks[b:size] = self.scratch_block
        for i, row in enumerate(block_rows):
            blocks[i, : len(row)] = row
        self.token_rows[:, :size].copy_(staging_t[:, :size], non_blocking=True)
        self.block_tables[:size].copy_(blocks_t[:size], non_blocking=True)
        self.staging.queued()
        self.block_staging.queued()
        return self.input_ids[:b]

    def replay(self, b: int, inputs_embeds: torch.Tensor | None):
        """Run the graph of the batch staged last (b real rows); returns (hidden, logits, captured)[:b]."""
        size = self._bucket(b)
        if self.inputs_embeds is not None:
            self.inputs_embeds[:b].copy_(inputs_embeds)
        self.graphs[size].replay()
        hidden, logits, captured = self.outputs[size]
        return hidden[:b], logits[:b], {k: v[:b] for k, v in captured.items()}

    def _bucket(self, b: int) -> int:
        return next(s for s in self.sizes if s >= b)
