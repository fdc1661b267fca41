"""The stage vocabulary: what goes into a stage, what comes out, and what drives it.

This module sits at the bottom of the package (it imports only `sampling_params`): the
orchestrator, the stage engines, the models and the transport all speak it.

- `StageRequest`: one request for one stage. `output_kind` says how its outputs come back
  (vLLM v1's `RequestOutputKind`): `DELTA`, an output whenever something new exists, or
  `FINAL_ONLY`, one output when the request finishes. Either way every `StageOutput` is a
  delta (what is new since the previous output of that request); only the orchestrator's
  request state accumulates.
- `StageOutput`: one such delta, `finished` on the last one; `error` set ends the request.
- `StageEngine`: what a stage worker drives (AR, generation, diffusion engines).
- `GenerationModel`: a single-pass stage model (code2wav) that a generation engine batches.

Tensors anywhere in a request or output travel as zero-copy frames (engine.transport).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import torch

from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

# additional_information key: [prompt_len, hidden] rows that replace the prompt's token embeddings.
PROMPT_EMBEDS_KEY = "prompt_embeds"


class OutputKind(enum.IntEnum):
    """How a stage reports a request (vLLM v1's RequestOutputKind, without CUMULATIVE)."""

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


def error_output(request_id: str, error: str) -> StageOutput:
    """The output that ends a request with an error (the stage goes on with the others)."""
    return StageOutput(request_id=request_id, finished=True, finish_reason="error", error=error)


class StageEngine(Protocol):
    """What a stage worker drives; nothing else. No method raises for one bad request: a
    request that cannot run comes back as an error output from the next `step()`."""

    def add_request(self, req: StageRequest) -> None: ...
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def step(self) -> list[StageOutput]: ...  # deltas of DELTA requests, finished outputs of all
    def has_unfinished(self) -> bool: ...
    def fail_all(self, error: str) -> list[StageOutput]: ...  # after a step raised
    def stats(self) -> dict[str, int]: ...  # fields of engine.messages.StageStats
    def describe(self) -> dict[str, Any]: ...  # reported once when the stage is ready


class GenerationModel(Protocol):
    """A non-autoregressive stage model: one call handles a whole batch.

    `GPUGenerationWorker` builds it with the class method `load(model_path, *, model_stage,
    device, dtype, load_format)` (load_format "dummy": random weights, nothing read);
    `generate_batch` returns one dict of named tensors per input, in order.
    """

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None, device: torch.device,
             dtype: str, load_format: str = "auto") -> GenerationModel: ...

    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]: ...
