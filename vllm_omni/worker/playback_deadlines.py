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

from vllm_omni.playback import DEFAULT_FIRST_AUDIO_TARGET_S, PlaybackTimeline


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

    def plan(self, ready: Sequence[str], new: Collection[str], in_flight: Sequence[str], *,
             can_launch: bool, overlapping: bool) -> StepPlan:
        """This step's calls from the streams with a chunk ready (`new`: those whose first chunk no
        step has taken; `in_flight`: streams whose later chunks are on the GPU, not collected yet)."""
        ordered = sorted(ready, key=self.deadline)
        first = [rid for rid in ordered if rid in new]
        later = [rid for rid in ordered if rid not in new]
        # The earliest deadline among playing streams: ready ones and those on the GPU (an aborted
        # stream's launched chunk has no timeline any more).
        due = min((self.deadline(rid) for rid in [*later, *in_flight] if rid in self._timelines), default=float("inf"))
        first = [rid for rid in first if self.deadline(rid) <= due]
        if not can_launch or (first and not overlapping):  # one call a step: first chunks are due first
            later = []
        return StepPlan(first, later)
