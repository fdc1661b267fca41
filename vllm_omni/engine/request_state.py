"""Per-request bookkeeping of the orchestrator: each stage's output (an OutputAccumulator) and timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_omni.engine.streaming import EdgeFlow
from vllm_omni.output_accumulator import OutputAccumulator
from vllm_omni.outputs import CompletionOutput, OmniRequestOutput, RequestOutput, RequestOutputKind
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageOutput


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

    output_kind: RequestOutputKind  # what the caller gets of its final stages' outputs

    def put(self, item: OmniRequestOutput | RequestDone) -> None: ...


@dataclass
class StageTiming:
    sent_at: float
    first_output_at: float | None = None
    finished_at: float | None = None


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
    outputs: dict[int, OutputAccumulator] = field(default_factory=dict)  # stage id -> its output so far
    finished_stages: set[int] = field(default_factory=set)
    timings: dict[int, StageTiming] = field(default_factory=dict)
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
        # The caller's outputs come as it asked; other stages' only feed bridges (whole outputs).
        kind = self.sink.output_kind if stage_id in self.output_stages else RequestOutputKind.FINAL_ONLY
        self.outputs[stage_id] = OutputAccumulator(self.request_id, prompt, prompt_token_ids, kind)
        self.timings[stage_id] = StageTiming(sent_at=time.monotonic())

    def output(self, stage_id: int) -> RequestOutput:
        """The stage's whole output so far (what bridges read)."""
        return self.outputs[stage_id].output

    def apply(self, stage_id: int, delta: StageOutput) -> tuple[RequestOutput, CompletionOutput] | None:
        """Fold one delta into the stage's output. -> what the caller gets now and what of it is
        new (for a final stage, as the caller asked), or None."""
        made = self.outputs[stage_id].add(delta)
        if delta.stage_durations:
            self.stage_durations.update(delta.stage_durations)
        timing = self.timings[stage_id]
        now = time.monotonic()
        if timing.first_output_at is None:
            timing.first_output_at = now
        if delta.finished:
            timing.finished_at = now
            self.finished_stages.add(stage_id)
        return made

    def final_output(self, stage_id: int, final_output_type: str,
                     made: tuple[RequestOutput, CompletionOutput]) -> OmniRequestOutput:
        out, new = made
        return OmniRequestOutput(self.request_id, stage_id, final_output_type, out, finished=out.finished, delta=new,
                                 stage_durations=dict(self.stage_durations))

    def timing_summary(self, names: dict[int, str]) -> str:
        now = time.monotonic()
        parts = [f"request {self.request_id}: e2e {now - self.arrived_at:.3f}s"]
        for stage_id in sorted(self.timings):
            t = self.timings[stage_id]
            first = f"{t.first_output_at - t.sent_at:.3f}s" if t.first_output_at else "-"
            total = f"{t.finished_at - t.sent_at:.3f}s" if t.finished_at else "-"
            n = len(self.output(stage_id).outputs[0].token_ids)
            parts.append(f"{names[stage_id]}: start +{t.sent_at - self.arrived_at:.3f}s, first output {first}, "
                         f"done {total}, {n} tokens")
        return "; ".join(parts)

