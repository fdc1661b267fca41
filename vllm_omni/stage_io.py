"""The stage vocabulary: what goes into a stage, what comes out, and what drives it.

This module sits at the bottom of the package (it imports only `sampling_params`): the
orchestrator, the stage engines, the models and the transport all speak it.

- `StageRequest`: one request for one stage. `output_kind` says how its outputs come back
  (vLLM v1's `RequestOutputKind`): `DELTA`, an output whenever something new exists, or
  `FINAL_ONLY`, one output when the request finishes. Either way every `StageOutput` is a
  delta (what is new since the previous output of that request), made so by the engine that
  produced it and passed on unchanged; the one place that accumulates is
  `output_accumulator.OutputAccumulator`.
- `StageOutput`: one such delta, `finished` on the last one; `error` set ends the request.
- `StageEngine`: what a stage worker drives (AR, generation, diffusion engines).
- `StreamingDecoder`: one request's incremental decode in a generation stage whose input streams
  in (the models themselves subclass `model_executor.models.generation_model.GenerationModel`).

Tensors anywhere in a request or output travel as zero-copy frames (engine.transport).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.outputs import RequestOutput
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

# additional_information key: [prompt_len, hidden] rows that replace the prompt's token embeddings.
PROMPT_EMBEDS_KEY = "prompt_embeds"
# additional_information key of a streaming generation stage's input units (codec frames, codes).
STREAM_UNITS_KEY = "units"


class OutputKind(enum.IntEnum):
    """How a stage reports a request (vLLM v1's RequestOutputKind, without CUMULATIVE: a stage
    never accumulates; what a caller receives is `outputs.RequestOutputKind`)."""

    DELTA = 1  # an output each time something new exists (streaming edges and callers)
    FINAL_ONLY = 2  # one output, when the request finishes


class StageRequest(msgspec.Struct, tag="add", kw_only=True):
    """One request for one stage; also what a stage engine (and a generation model) receives."""

    request_id: str  # the orchestrator's internal key, unique per submission
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | DiffusionSamplingParams  # the latter for diffusion stages
    prompt: str | None = None
    # Per-request payloads built by a bridge (spec 003 OmniTokensPrompt.additional_information).
    additional_information: dict[str, Any] = {}
    multi_modal_data: dict[str, Any] | None = None
    output_kind: OutputKind = OutputKind.FINAL_ONLY
    # False: the request's input streams in (a streaming edge); StageInputChunks follow, the
    # last one with `final`. The stage starts on what it has and waits for what it lacks.
    input_complete: bool = True


class StageInputChunk(msgspec.Struct, tag="chunk", kw_only=True):
    """More input for a request whose input streams in (a delta of its upstream stage).

    `additional_information` holds rows to append, keyed as the stage model expects (an AR
    stage model's `append_request_inputs`; a streaming generation model gets its units under
    STREAM_UNITS_KEY). `final`: nothing more will come."""

    request_id: str
    additional_information: dict[str, Any] = {}
    final: bool = False


class StageOutput(msgspec.Struct, kw_only=True):
    """What one request produced since its previous StageOutput (a delta)."""

    request_id: str
    finished: bool
    new_token_ids: list[int] = []
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # Named tensors for the next stage or the user (hidden states, codec codes, audio, ...).
    # Rows along dim 0 are new rows; a 0-dim tensor is metadata (e.g. a sample rate).
    multimodal_output: dict[str, torch.Tensor] = {}
    error: str | None = None
    # A request whose input streams in: input units used so far (flow control upstream).
    consumed_units: int | None = None
    num_cached_tokens: int = 0  # prompt tokens an AR stage served from its prefix cache
    # Seconds each phase of the request took in this stage, by name (a stage's profiler, when
    # on: --enable-ar-profiler, --enable-diffusion-pipeline-profiler); on the finished output.
    stage_durations: dict[str, float] | None = None


class VideoInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a video model tells a video API before a request runs (DiffusionModel.video_info)."""

    fps: int  # the frame rate its videos are made for
    frame_step: int  # frame counts are 1 + a multiple of this (the VAE's temporal factor)
    size_multiple: int  # heights and widths are multiples of this (pixels)
    default_size: str  # "WxH" when a request names none
    image_input: str  # a reference image: "required", "optional" or "none"


class StageInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a stage engine reports about itself once it is ready (`StageEngine.describe`, sent in
    engine.messages.StageReady). The typed fields drive decisions; `details` is only shown."""

    engine: str  # "ar", "generation", "diffusion" or "diffusers"
    device: str
    # A streaming edge may feed it (engine/streaming.py), and then its decoder may wait for up to
    # this many units before it can decode (flow control never holds the producer below that).
    accepts_streamed_input: bool = False
    stream_units_per_chunk: int | None = None
    # AR stages: prompt limits are checked against these before a request is queued.
    max_model_len: int | None = None
    vocab_size: int | None = None
    max_batch_size: int | None = None
    kv_total_blocks: int | None = None
    video: VideoInfo | None = None  # a video model's (diffusion stages)
    details: dict[str, Any] = {}  # what else it says of itself (dtype, a diffusion model's parts)


def error_output(request_id: str, error: str) -> StageOutput:
    """The output that ends a request with an error (the stage goes on with the others)."""
    return StageOutput(request_id=request_id, finished=True, finish_reason="error", error=error)


class StageEngine(Protocol):
    """What a stage worker drives; nothing else. No method raises for one bad request: a
    request that cannot run comes back as an error output from the next `step()`."""

    def add_request(self, req: StageRequest) -> None: ...
    def add_input(self, chunk: StageInputChunk) -> None: ...  # more input of a streaming request
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def pause(self, request_ids: Sequence[str], paused: bool) -> None: ...  # flow control
    def step(self) -> list[StageOutput]: ...  # deltas of DELTA requests, finished outputs of all
    # A step would make progress now. Requests waiting for streamed input or paused do not
    # count: the worker then blocks on its socket instead of spinning.
    def has_work(self) -> bool: ...
    # With work on the device that a later step collects, how soon to step again if no message
    # comes; None: block as usual.
    def poll_ms(self) -> int | None: ...
    def fail_all(self, error: str) -> list[StageOutput]: ...  # after a step raised
    def stats(self) -> dict[str, Any]: ...  # fields of engine.messages.StageStats
    def describe(self) -> StageInfo: ...  # reported once when the stage is ready


class StreamingDecoder(Protocol):
    """One request's incremental decode in a streaming generation stage (code2wav fed by a
    talker as it generates). Input arrives in units along dim 0 (a Qwen3 codec frame [G], a
    Qwen2.5 codec code []); the decoder chooses when enough has arrived to decode a chunk (a
    small first chunk, then larger ones, each with the left context it needs)."""

    def push(self, units: torch.Tensor, final: bool) -> None: ...  # new units [n, ...]; final: no more
    def ready(self) -> bool: ...  # a chunk can be decoded now
    @property
    def finished(self) -> bool: ...  # final was pushed and everything is decoded
    @property
    def consumed(self) -> int: ...  # units decoded so far (the stage reports it for backpressure)


@dataclass(frozen=True)
class StreamBridge:
    """How a streaming edge feeds its downstream stage (a family record names one per stage;
    the spec 003 bridge stays what an edge uses when it runs on completion).

    start(upstream, prompt): the downstream request from the upstream output so far (finished or
      not) and the user's prompt, or None until enough exists (a talker needs the thinker's
      first reply row). ValueError: the request cannot go on.
    chunk(delta): the input one later upstream delta adds (row tensors, keyed as the downstream
      stage reads them; an empty dict when it adds nothing).
    prompt_token_ids(units): for a streaming generation stage, all the units it was sent (under
      STREAM_UNITS_KEY) as the prompt ids the edge's spec 003 bridge would have given it (the
      downstream output reports them, as without streaming); None: keep the start's ids."""

    start: Callable[[RequestOutput, Any], OmniTokensPrompt | None]
    chunk: Callable[[StageOutput], dict[str, torch.Tensor]]
    prompt_token_ids: Callable[[torch.Tensor], list[int]] | None = None
