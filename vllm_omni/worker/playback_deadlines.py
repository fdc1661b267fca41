"""Which streams a streaming generation stage (code2wav) decodes next: by playback deadline.

The stage produces the audio, so it keeps each stream's playback timeline from its own output
(`playback.PlaybackTimeline`: first chunk emitted at t0, then audio_s seconds; the listener has
sound until t0 + audio_s). Each step:

- the ready streams are taken earliest deadline first (a playing stream with little sound left
  before one with seconds of it; a stream skipped keeps its deadline while the others' move on,
  so none starves);
- a new stream's first chunk (due at its arrival + the first-audio target) goes only when no
  playing stream is due sooner, counting those whose chunks are already on the GPU
  (decode_lanes.py: a first chunk on the urgent lane would run ahead of them). Otherwise it waits
  a step: under load a new request starts later, and no playing stream runs dry for it.
  `VLLM_OMNI_FIRST_CHUNK_HOLD=margin` (a candidate for A/B runs, not the default: on the CPU's
  burst timeline it starts new streams sooner and lets some of their own ramps run dry) holds
  it only for a playing stream due sooner that is also close to running dry: one with less
  sound left than a call of first chunks and then its own call take (measured, `timed_call`,
  plus a floor; the k-th ready stream by deadline waits for k // per_call calls before its own).

On lanes that run one call at a time (the CPU, Qwen2.5 token2wav) a step decodes either first
chunks or later ones, whichever holds the earliest deadline; on overlapping lanes the later
chunks are launched and the first chunks decoded at once, unless the rule above holds them.
docs/streaming.md ("Scheduling by playback deadline") walks through a timeline.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

import vllm_omni.envs as envs
from vllm_omni.playback import DEFAULT_FIRST_AUDIO_TARGET_S, PlaybackTimeline

# The hold margin's floor: what a step's timing is off by on a loaded host (the loop's poll, the
# hand-off to the orchestrator) when no call has been measured yet.
MIN_HOLD_MARGIN_S = 0.02
# A call's duration estimate follows a longer call at once and decays towards shorter ones by
# this factor a call (a peak over the last few dozen calls): a margin errs towards holding.
CALL_ESTIMATE_DECAY = 0.95


@dataclass(frozen=True)
class StepPlan:
    first: list[str]  # new streams whose first chunks are decoded now, earliest deadline first
    later: list[str]  # playing streams whose next chunks are decoded (launched), earliest first


class StreamDeadlines:
    def __init__(self, first_audio_target_s: float = DEFAULT_FIRST_AUDIO_TARGET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_audio_target_s = first_audio_target_s
        self.clock = clock
        self._timelines: dict[str, PlaybackTimeline] = {}
        self._sample_rates: dict[str, int] = {}
        self._call_s = {"first": 0.0, "later": 0.0}  # recent peak duration of each kind of call
        # `deadline` (A/B runs, the rule before): any playing stream due sooner holds a first chunk.
        self._hold_by_deadline_only = envs.FIRST_CHUNK_HOLD.get() == "deadline"

    def open(self, request_id: str) -> None:
        self._timelines[request_id] = PlaybackTimeline(self.clock(), self.first_audio_target_s)

    def close(self, request_id: str) -> None:
        self._timelines.pop(request_id, None)
        self._sample_rates.pop(request_id, None)

    def timeline(self, request_id: str) -> PlaybackTimeline:
        return self._timelines[request_id]

    def deadline(self, request_id: str) -> float:
        return self._timelines[request_id].deadline

    def record(self, request_id: str, result: Mapping[str, torch.Tensor]) -> None:
        """A chunk of this stream goes out now: {"audio": new samples, "sample_rate": 0-dim (first
        chunk)}. Without a sample rate (yet) its samples cannot be timed and count as none."""
        timeline = self._timelines.get(request_id)
        if timeline is None:
            return
        rate = result.get("sample_rate")
        if rate is not None:
            self._sample_rates[request_id] = int(rate)
        audio, rate = result.get("audio"), self._sample_rates.get(request_id)
        timeline.emitted(self.clock(), audio.numel() / rate if audio is not None and rate else 0.0)

    @property
    def by_margin(self) -> bool:
        """`VLLM_OMNI_FIRST_CHUNK_HOLD=margin`: `plan` reads `per_call` (the default rule does not)."""
        return not self._hold_by_deadline_only

    def timed_call(self, kind: str, seconds: float) -> None:
        """A call of `kind` ("first": new streams' first chunks; "later": launched to collected)
        took `seconds` on this clock."""
        self._call_s[kind] = max(seconds, self._call_s[kind] * CALL_ESTIMATE_DECAY)

    def margin_s(self, calls_before: int = 0) -> float:
        """The sound a playing stream needs left, to let a call of first chunks go before its own
        chunk, behind `calls_before` calls of other playing streams."""
        return MIN_HOLD_MARGIN_S + self._call_s["first"] + (calls_before + 1) * self._call_s["later"]

    def plan(self, ready: Sequence[str], new: Collection[str], in_flight: Sequence[str], *,
             can_launch: bool, overlapping: bool, per_call: int = 1) -> StepPlan:
        """This step's calls from the streams with a chunk ready (`new`: those whose first chunk no
        step has taken; `in_flight`: streams whose later chunks are on the GPU, not collected yet;
        `per_call`: how many playing streams a call takes)."""
        ordered = sorted(ready, key=self.deadline)
        first = [rid for rid in ordered if rid in new]
        later = [rid for rid in ordered if rid not in new]
        if first:
            # The earliest deadline of a playing stream (close to running dry, by margin): on the
            # GPU (an aborted stream's launched chunk has no timeline any more), or ready, behind
            # the launch on the GPU and the ready ones due before it.
            now = self.clock()
            short = [rid for rid in in_flight if rid in self._timelines and self._short(rid, now, 0)]
            queued = 1 if in_flight else 0
            short += [rid for k, rid in enumerate(later) if self._short(rid, now, queued + k // max(1, per_call))]
            due = min(map(self.deadline, short), default=float("inf"))
            first = [rid for rid in first if self.deadline(rid) <= due]
        if not can_launch or (first and not overlapping):  # one call a step: first chunks are due first
            later = []
        return StepPlan(first, later)

    def _short(self, request_id: str, now: float, calls_before: int) -> bool:
        """Whether this playing stream would run dry if a call of first chunks went before it."""
        return self._hold_by_deadline_only or self.deadline(request_id) - now < self.margin_s(calls_before)
