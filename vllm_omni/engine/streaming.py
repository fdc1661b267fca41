"""Streaming edges (async_chunk): a downstream stage starts on a request before its upstream
stage has finished it, and gets the rest as the upstream stage produces it.

Which edges stream: every edge when the pipeline says `async_chunk: true` (deploy YAMLs,
`--async-chunk`), and any edge with `window_size > 0` (spec 000); but only where the downstream
stage's family has a stream bridge for it (`ModelFamily.stream_bridges`), the stage has one
source and its config names no custom bridge of its own, and its model takes streamed input
(the stage says so when it is ready). Any other edge runs on completion, as with
`window_size: -1`.

Per request and streaming edge (`EdgeFlow`): the bridge's `start` builds the downstream
request from the upstream output so far (None: not yet); after that, each upstream delta's
`chunk` goes on as a `StageInputChunk` (every delta, or every `window_size` units), the last
one `final`. Flow control: the downstream stage reports the units it has consumed; when the
units sent but not consumed pass `max_pending_units`, the upstream stage pauses the request
(it keeps its KV blocks) until the backlog is down to a quarter of that. So a slow consumer
slows its producer and the queue between them stays bounded. The limit is never below twice
what the consumer may need before it can consume anything (a decoder's chunk and look-ahead:
`stream_units_per_chunk`), or a paused producer would wait for a consumer waiting for it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.imports import import_dotted
from vllm_omni.stage_io import STREAM_UNITS_KEY, StageInfo, StreamBridge

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingEdge:
    src: int
    dst: int
    bridge: StreamBridge
    window: int  # units per message (1: every upstream delta)
    max_pending_units: int  # sent but not consumed; beyond it the upstream request pauses

    @property
    def resume_below(self) -> int:
        return self.max_pending_units // 4


@dataclass
class EdgeFlow:
    """One request on one streaming edge."""

    started: bool = False
    sent: int = 0  # units sent after the start
    consumed: int = 0  # units the downstream stage reports as used
    paused: bool = False  # the upstream stage holds the request back
    pending: list[dict[str, torch.Tensor]] = field(default_factory=list)  # not sent yet (window)
    pending_units: int = 0
    units: GrowingTensor | None = None  # everything sent under STREAM_UNITS_KEY (its prompt ids)

    @property
    def backlog(self) -> int:
        return self.sent - self.consumed

    def hold(self, chunk: dict[str, torch.Tensor]) -> None:
        if chunk:
            self.pending.append(chunk)
            self.pending_units += num_units(chunk)

    def record_units(self, info: Mapping[str, Any]) -> None:
        units = info.get(STREAM_UNITS_KEY)
        if isinstance(units, torch.Tensor) and units.numel():
            if self.units is None:
                self.units = GrowingTensor(units)
            else:
                self.units.append(units)

    def take(self) -> dict[str, torch.Tensor]:
        """The held chunks as one (rows concatenated per key)."""
        merged = merge_chunks(self.pending)
        self.sent += self.pending_units
        self.pending, self.pending_units = [], 0
        return merged


def num_units(chunk: Mapping[str, Any]) -> int:
    """Rows of a chunk's tensors (they share their first dimension)."""
    return max((t.shape[0] for t in chunk.values() if isinstance(t, torch.Tensor) and t.dim()), default=0)


def merge_chunks(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(chunks) == 1:
        return chunks[0]
    return {key: torch.cat([c[key] for c in chunks]) for key in chunks[0]} if chunks else {}


def resolve_streaming_edges(pipeline: PipelineConfig, model: str, stage_info: Mapping[int, StageInfo | None],
                            max_pending_units: int) -> dict[int, StreamingEdge]:
    """Streaming edges by downstream stage id; `stage_info` is what each stage reported when ready."""
    edges = {}
    for edge in pipeline.edges:
        if not (pipeline.async_chunk or edge.window_size > 0):
            continue
        dst = pipeline.stage(edge.to_stage)
        info = stage_info.get(dst.stage_id)
        reason = _why_not_streaming(dst, model, info)
        if isinstance(reason, str):
            logger.info("edge %d -> %d runs on completion: %s", edge.from_stage, edge.to_stage, reason)
            continue
        # Never hold the producer back below what the consumer needs to make any progress.
        needed = 2 * (info.stream_units_per_chunk or 1)
        edges[dst.stage_id] = StreamingEdge(edge.from_stage, dst.stage_id, reason,
                                            max(edge.window_size, 1), max(max_pending_units, needed))
    return edges


def _why_not_streaming(stage: StageConfig, model: str, info: StageInfo | None) -> StreamBridge | str:
    """The stage's stream bridge, or why its input edge cannot stream."""
    from vllm_omni.config.bundled import model_architecture
    from vllm_omni.model_executor.models.families import FAMILIES

    if len(stage.engine_input_source) != 1:
        return f"stage {stage.stage_id} has {len(stage.engine_input_source)} sources"
    arch = stage.engine_args.model_arch
    folder = stage.engine_args.model or model
    if arch is None and (Path(folder) / "config.json").is_file():
        arch = model_architecture(folder)
    family = next((f for f in FAMILIES if arch in f.architectures), None)
    path = family.stream_bridges.get(stage.model_stage) if family is not None else None
    if path is None:
        return f"no stream bridge for stage {stage.stage_id} ({arch}, {stage.model_stage})"
    custom = stage.custom_process_input_func
    if custom is not None and custom != family.bridges.get(stage.model_stage):
        return f"stage {stage.stage_id} names its own bridge {custom}"
    if info is None or not info.accepts_streamed_input:
        return f"stage {stage.stage_id}'s model does not take streamed input"
    return import_dotted(path)
