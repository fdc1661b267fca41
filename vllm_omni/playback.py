"""Playback deadlines: the moment a streamed audio's listener runs out of sound.

A client starts playing a stream at its first audio chunk and plays the chunks back to back,
so after the chunks emitted so far it has sound until

    deadline = first_emit_at + audio_s          (audio_s: seconds of audio emitted so far)

and its buffer at `now` is `deadline - now` (negative: it has been silent that long). A stream
whose first audio is not out yet is due at `waiting_since + first_audio_target_s` (it waits
since its arrival, or since its last chunk when that chunk held no audio): a new request waits
for its first audio no longer than the target unless streams already playing have less sound
left than that. Ordering everything by deadline (earliest first) is what the stages do
(docs/streaming.md, "Scheduling by playback deadline"): under load, new requests start later,
streams already playing do not run dry.

Every clock here is the caller's (time.monotonic in the stages, a fake one in tests); a deadline
only compares with times of the same clock, so each process keeps its own timelines.
"""
from __future__ import annotations

from dataclasses import dataclass

# A new stream's first chunk is due this long after it arrives: it goes before a playing stream
# only when that stream has more sound left than this.
DEFAULT_FIRST_AUDIO_TARGET_S = 0.1


@dataclass
class PlaybackTimeline:
    """One stream's audio as its listener hears it (see the module docstring)."""

    waiting_since: float  # its arrival, or its last chunk if that held no audio
    first_audio_target_s: float = DEFAULT_FIRST_AUDIO_TARGET_S
    first_emit_at: float | None = None
    audio_s: float = 0.0

    @property
    def playing(self) -> bool:
        return self.first_emit_at is not None

    def emitted(self, now: float, seconds: float) -> None:
        """A chunk of `seconds` of audio went out at `now`. One without audio (or that cannot be
        timed: seconds 0) starts nothing: the stream waits for its first audio again from now."""
        if seconds <= 0:
            if self.first_emit_at is None:
                self.waiting_since = now
            return
        if self.first_emit_at is None:
            self.first_emit_at = now
        self.audio_s += seconds

    @property
    def deadline(self) -> float:
        if self.first_emit_at is None:
            return self.waiting_since + self.first_audio_target_s
        return self.first_emit_at + self.audio_s

    def buffered(self, now: float) -> float:
        """Seconds of sound the listener has left at `now` (< 0: silent that long)."""
        return self.deadline - now


def token_deadline(arrived_at: float, num_output_tokens: int, seconds_per_token: float,
                   first_audio_target_s: float = DEFAULT_FIRST_AUDIO_TARGET_S) -> float:
    """The deadline of a talker's request (an AR stage whose tokens become audio downstream),
    from what that stage knows: it arrived at `arrived_at` and has made `num_output_tokens`, each
    `seconds_per_token` of audio. Its listener is taken to have started at the first-audio target:
    a stream that started later has more sound left than this says (the estimate errs towards
    urgency); with no token yet it is a new stream's first-chunk deadline."""
    return arrived_at + first_audio_target_s + num_output_tokens * seconds_per_token
