"""Typed messages between the orchestrator and the stage workers.

Requests and outputs are the stage vocabulary (`vllm_omni.stage_io`); this module adds the
control messages around them and the two unions a socket carries.

Every message is a tagged msgspec Struct, so a socket carries one union type per
direction and a decoder rejects anything else. Tensors anywhere in a message
(`multimodal_output`, `additional_information` values) are taken out of the msgpack
header by `transport.MessageCodec` and sent as separate zero-copy frames or shared
memory segments.

Outputs are deltas (new tokens, new text, new tensors since the last message of that
request) with a `finished` flag, so the same protocol serves streaming edges: the
orchestrator accumulates them into `RequestOutput`s.
"""
from __future__ import annotations

from typing import Union

import msgspec

from vllm_omni.stage_io import StageInfo, StageInputChunk, StageOutput, StageRequest

# --------------------------------------------------------------------------- orchestrator -> worker


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class PauseRequests(msgspec.Struct, tag="pause"):
    """Flow control: stop scheduling these requests (their consumers are behind) until resumed;
    they keep their KV blocks."""

    request_ids: list[str]
    paused: bool = True


class StatsRequest(msgspec.Struct, tag="stats_request"):
    nonce: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SleepRequest(msgspec.Struct, tag="sleep", kw_only=True):
    """Sleep mode (vLLM's POST /sleep and /wake_up; worker/sleep_mode.py): `sleep` at `level` (1: keep
    the weights in CPU memory, 2: drop them), or wake up (`sleep` false) the parts named in `tags`
    ("weights", "kv_cache"; None: all). The stage answers with a SleepStatus of the same nonce."""

    nonce: int
    sleep: bool
    level: int = 1
    tags: list[str] | None = None


ToWorker = Union[StageRequest, StageInputChunk, AbortRequests, PauseRequests, StatsRequest, SleepRequest, Shutdown]

# --------------------------------------------------------------------------- worker -> orchestrator


class StageReady(msgspec.Struct, tag="ready"):
    stage_id: int
    pid: int
    info: StageInfo  # what the engine reports about itself (stage_io.StageEngine.describe)


class StageInitFailed(msgspec.Struct, tag="init_failed"):
    stage_id: int
    pid: int
    error: str  # includes the traceback


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stage_id: int
    pid: int


class StageFatal(msgspec.Struct, tag="fatal"):
    """The worker loop itself failed; the stage is going down."""

    stage_id: int
    error: str


class StageOutputBatch(msgspec.Struct, tag="outputs"):
    """All outputs of one engine step: one message per step, not one per request."""

    stage_id: int
    outputs: list[StageOutput]


class StageStats(msgspec.Struct, tag="stats", kw_only=True):
    nonce: int
    stage_id: int
    num_unfinished: int
    kv_free_blocks: int | None = None  # AR stages only
    kv_total_blocks: int | None = None
    num_waiting: int | None = None  # generation stages: queued requests
    num_running: int | None = None  # diffusion stages: requests in the running batch
    diffusion_steps: int | None = None  # diffusion stages: request-steps denoised since the stage started
    # Where the requests it holds are, by the engine's own names (a talker's running / waiting /
    # blocked on input; a code2wav's streams ready / new / on the device): for a run that stalls.
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    # The stage's inbox: messages and connections it dropped since it started, by reason (/metrics;
    # engine/transport_guard.py).
    transport_drops: dict[str, int] = msgspec.field(default_factory=dict)


class SleepStatus(msgspec.Struct, tag="sleep_status", kw_only=True):
    """A stage's answer to a SleepRequest: whether it sleeps now, or why it did not do as asked."""

    nonce: int
    stage_id: int
    sleeping: bool
    error: str | None = None
    busy: bool = False  # refused: requests are in flight


FromWorker = Union[StageReady, StageInitFailed, Heartbeat, StageFatal, StageOutputBatch, StageStats, SleepStatus]
