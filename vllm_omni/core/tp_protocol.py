"""What rank 0 of a tensor-parallel engine tells the other ranks, and how they follow.

Every rank runs the same `ARModelRunner.execute` on the same batch, so every rank must hold
the same requests: prompt, per-request model inputs (media features, prompt embeddings) and
the per-step counters the model hooks read. Rank 0 owns the scheduler; before each step it
sends a `StepPlan` with what changed since the last one (new requests once, then per scheduled
request the tokens sampled since and its block ids), and the other ranks mirror it in plain
`Request` objects (`ShadowRequests`). Model state a hook builds (M-RoPE positions, encoder
outputs) is rebuilt on each rank from the same inputs, so the towers run on every rank.

Messages travel pickled over one pipe per rank: tensors in them are CPU tensors sent once per
request; the per-step part is a few lists of ints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.core.request import Request
from vllm_omni.core.scheduler import ScheduledRequest, SchedulerOutput
from vllm_omni.sampling_params import SamplingParams


# --- rank 0 -> other ranks -------------------------------------------------------------
@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor | None
    model_inputs: Any  # the model's parsed inputs (StageModel.parse_request_inputs)


@dataclass(frozen=True)
class ScheduledSpan:
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    appended_token_ids: list[int]  # output tokens rank 0 sampled since it last sent this request
    kept_blocks: int  # leading block ids unchanged since then
    new_block_ids: list[int]


@dataclass(frozen=True)
class StepPlan:
    step: int
    new_requests: list[NewRequest]
    finished: list[str]  # requests no step will schedule again: drop them
    spans: list[ScheduledSpan]


@dataclass(frozen=True)
class Probe:
    """After rank 0's step failed: did you come out of step `step` too?"""

    step: int


@dataclass(frozen=True)
class Shutdown:
    pass


# --- other ranks -> rank 0 -------------------------------------------------------------
@dataclass(frozen=True)
class RankStarted:
    rank: int


@dataclass(frozen=True)
class RankReady:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    rank: int
    error: str  # traceback; the rank exits right after sending it


@dataclass(frozen=True)
class StepStatus:
    rank: int
    step: int
    error: str | None  # the rank's own exception in that step, or None


# --- rank 0: what the other ranks know --------------------------------------------------
@dataclass
class _Sent:
    request: Request
    num_tokens: int  # len(token_ids) the ranks hold
    block_ids: list[int] = field(default_factory=list)


class StepPlanner:
    """Rank 0's record of what the other ranks hold, turned into each step's delta."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def plan(self, step: int, sched: SchedulerOutput) -> StepPlan:
        finished = [rid for rid, sent in self._sent.items() if sent.request.status.finished]
        for rid in finished:
            del self._sent[rid]
        new, spans = [], []
        for item in sched.scheduled:
            req = item.request
            sent = self._sent.get(req.request_id)
            if sent is None or sent.request is not req:  # first step (or an id reused after finishing)
                new.append(NewRequest(req.request_id, req.prompt_token_ids, req.prompt_embeds, req.model_inputs))
                sent = self._sent[req.request_id] = _Sent(req, req.num_prompt_tokens)
            kept = _common_prefix(sent.block_ids, req.block_ids)
            spans.append(ScheduledSpan(req.request_id, req.num_computed_tokens, item.num_new_tokens,
                                       req.token_ids[sent.num_tokens:], kept, req.block_ids[kept:]))
            sent.num_tokens, sent.block_ids = req.num_tokens, list(req.block_ids)
        return StepPlan(step, new, finished, spans)


def _common_prefix(old: list[int], new: list[int]) -> int:
    """Block lists only grow while a request runs; a preempted one starts over."""
    n = len(old)
    return n if len(new) >= n and new[:n] == old else 0


# --- other ranks: the mirrored requests -------------------------------------------------
class ShadowRequests:
    """A rank's copy of the requests rank 0 schedules, kept in step by `StepPlan`s."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        for rid in plan.finished:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            # Sampling happens on rank 0 only: the params here are never read.
            self.requests[new.request_id] = Request(new.request_id, new.prompt_token_ids, SamplingParams(),
                                                    prompt_embeds=new.prompt_embeds, model_inputs=new.model_inputs)
        out = SchedulerOutput()
        for span in plan.spans:
            req = self.requests[span.request_id]
            req.token_ids.extend(span.appended_token_ids)
            req.num_computed_tokens = span.num_computed_tokens
            req.block_ids = req.block_ids[: span.kept_blocks] + span.new_block_ids
            out.scheduled.append(ScheduledRequest(req, span.num_new_tokens))
        return out
