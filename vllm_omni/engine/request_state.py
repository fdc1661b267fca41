"""Per-request bookkeeping of the orchestrator: accumulated outputs per stage and timings."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_omni.engine.streaming import EdgeFlow
from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.stage_io import StageOutput
from vllm_omni.outputs import CompletionOutput, OmniRequestOutput, RequestOutput
from vllm_omni.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestDone:
    """The last item a sink receives for a request."""

    request_id: str
    error: str | None = None
    failed_stage: int | None = None
    aborted: bool = False
    overloaded: bool = False  # not admitted: the pipeline is at its playback load (HTTP 429)


class RequestSink(Protocol):
    """Where the orchestrator delivers a request's outputs; called on the orchestrator's thread."""

    wants_partial: bool  # also deliver unfinished outputs of final stages (streaming)

    def put(self, item: OmniRequestOutput | RequestDone) -> None: ...


@dataclass
class StageTiming:
    sent_at: float
    first_output_at: float | None = None
    finished_at: float | None = None


def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1  # a scalar counts as one row


@dataclass
class _Delivered:
    """How much of one stage's output the caller has received."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    rows: dict[str, int] = field(default_factory=dict)  # tensor rows per multimodal_output key


@dataclass
class RequestState:
    request_id: str  # the user's id
    key: str  # unique per submission; the id the stages see
    prompt: Any  # the parsed user prompt (TextPrompt / OmniTokensPrompt), passed to bridges
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per stage
    sink: RequestSink
    stages: frozenset[int]  # the stages that run for this request (request_plan.RequestPlan)
    output_stages: frozenset[int]  # the final stages whose outputs go to the caller
    arrived_at: float = field(default_factory=time.monotonic)
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # stage id -> accumulated output
    finished_stages: set[int] = field(default_factory=set)
    timings: dict[int, StageTiming] = field(default_factory=dict)
    delivered: dict[int, _Delivered] = field(default_factory=dict)  # stage id -> what the caller has
    # Tensor outputs that stream in as row chunks (hidden states, codec frames, audio), per stage.
    tensors: dict[int, dict[str, GrowingTensor]] = field(default_factory=dict)
    flows: dict[int, EdgeFlow] = field(default_factory=dict)  # streaming edges, by downstream stage
    failure: tuple[str, int | None] | None = None  # (error, stage) of a stage that failed it, the rest going on
    # What each stage was sent for this request until it answered (a request, then streamed input
    # chunks): replayed to another replica if the one holding the request dies first (at most once).
    replay: dict[int, list[Any]] = field(default_factory=dict)
    retried: set[int] = field(default_factory=set)  # stages where the request moved to another replica
    # Seconds per phase in the stages that profile the request (OmniRequestOutput.stage_durations).
    stage_durations: dict[str, float] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.finished_stages >= self.stages

    def start_stage(self, stage_id: int, prompt_token_ids: list[int], prompt: str | None) -> None:
        self.outputs[stage_id] = RequestOutput(
            request_id=self.request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(index=0, text="", token_ids=[])],
            finished=False,
        )
        self.timings[stage_id] = StageTiming(sent_at=time.monotonic())

    def apply(self, stage_id: int, delta: StageOutput) -> RequestOutput:
        """Fold one delta into the stage's accumulated output."""
        out = self.outputs[stage_id]
        comp = out.outputs[0]
        comp.token_ids.extend(delta.new_token_ids)
        comp.text += delta.new_text
        if delta.new_logprobs is not None:
            comp.logprobs = (comp.logprobs or []) + list(delta.new_logprobs)
        comp.cumulative_logprob = delta.cumulative_logprob
        comp.finish_reason = delta.finish_reason
        comp.stop_reason = delta.stop_reason
        grown = self.tensors.setdefault(stage_id, {})
        for key, tensor in delta.multimodal_output.items():
            # Tensor deltas of streaming stages are chunks along the first dimension; a 0-dim
            # tensor is metadata (e.g. an audio sample rate) and replaces the previous value.
            if tensor.dim() == 0:
                comp.multimodal_output[key] = tensor
            elif key in grown:
                comp.multimodal_output[key] = grown[key].append(tensor)
            else:
                grown[key] = GrowingTensor(tensor)
                comp.multimodal_output[key] = grown[key].view
        out.finished = delta.finished
        out.error = delta.error
        if delta.stage_durations:
            self.stage_durations.update(delta.stage_durations)
        timing = self.timings[stage_id]
        now = time.monotonic()
        if timing.first_output_at is None:
            timing.first_output_at = now
        if delta.finished:
            timing.finished_at = now
            self.finished_stages.add(stage_id)
        return out

    def final_output(self, stage_id: int, final_output_type: str, partial: bool) -> OmniRequestOutput:
        out = self.outputs[stage_id]
        if partial:  # a snapshot: the accumulated object keeps changing
            out = copy.copy(out)
            out.outputs = [copy.copy(out.outputs[0])]
            out.outputs[0].token_ids = list(out.outputs[0].token_ids)
            out.outputs[0].multimodal_output = dict(out.outputs[0].multimodal_output)
        return OmniRequestOutput(self.request_id, stage_id, final_output_type, out, finished=out.finished,
                                 delta=self._delta(stage_id, out.outputs[0]),
                                 stage_durations=dict(self.stage_durations))

    def _delta(self, stage_id: int, comp: CompletionOutput) -> CompletionOutput:
        """What the caller has not seen yet of a stage's output (see OmniRequestOutput.delta)."""
        seen = self.delivered.setdefault(stage_id, _Delivered())
        new_tensors = {}
        for key, tensor in comp.multimodal_output.items():
            start = seen.rows.get(key, 0)
            if _rows(tensor) > start:
                new_tensors[key] = tensor[start:] if tensor.dim() else tensor
            seen.rows[key] = _rows(tensor)
        delta = CompletionOutput(
            index=comp.index, text=comp.text[seen.text:], token_ids=comp.token_ids[seen.tokens:],
            cumulative_logprob=comp.cumulative_logprob,
            logprobs=comp.logprobs[seen.logprobs:] if comp.logprobs is not None else None,
            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, multimodal_output=new_tensors,
        )
        seen.text, seen.tokens = len(comp.text), len(comp.token_ids)
        seen.logprobs = len(comp.logprobs) if comp.logprobs is not None else 0
        return delta

    def timing_summary(self, names: dict[int, str]) -> str:
        now = time.monotonic()
        parts = [f"request {self.request_id}: e2e {now - self.arrived_at:.3f}s"]
        for stage_id in sorted(self.timings):
            t = self.timings[stage_id]
            first = f"{t.first_output_at - t.sent_at:.3f}s" if t.first_output_at else "-"
            total = f"{t.finished_at - t.sent_at:.3f}s" if t.finished_at else "-"
            n = len(self.outputs[stage_id].outputs[0].token_ids)
            parts.append(f"{names[stage_id]}: start +{t.sent_at - self.arrived_at:.3f}s, first output {first}, "
                         f"done {total}, {n} tokens")
        return "; ".join(parts)

