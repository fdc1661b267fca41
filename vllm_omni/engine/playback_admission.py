"""Admission by playback load: a new audio request starts only while the pipeline can keep the
streams already playing fed (docs/streaming.md, "Admission by playback load").

The load is measured from the audio the pipeline hands on (the orchestrator sees every chunk):
over the last `window_s`, each chunk of a playing stream after its first took the wall time
since that stream's previous chunk to make its seconds of audio. Their ratio, summed over the
window,

    rtf = sum(time since the stream's previous chunk) / sum(seconds of audio in the chunks)

is the time the pipeline now needs to make one second of audio for one listener. With the m
streams measured sharing the GPUs that is m x (GPU time per second of audio of each stream): the
sum over the playing streams of what each costs, in GPU-seconds per second (a stream sharing a
step with others pays its share of it). Above 1 the streams cannot be fed in real time. Every
admitted stream adds its share, rtf / m, measured or not yet playing: the estimate with one more
is rtf x (n + 1) / m (n: audio requests admitted and not finished). A new audio request is
admitted while that is at most 1 - headroom; with nothing measured (a cold start, an idle
pipeline) it is admitted. Batching makes a new stream cost less than the average (the estimate
errs towards waiting), and a stream whose producer runs ahead of its consumer (flow control)
measures the consumer.

Policies (`--admission-policy`): `queue`: a request that does not fit waits, first in first out,
until it fits or `max_wait_s` passes (then it fails as overloaded: HTTP 429); `reject`: it fails
at once; `off` (the default): no load-based admission. Requests without audio output are never
held, and neither is one that would be the only stream (nothing else to protect). Off by default
because on a pipeline slower than real time at one stream (the CPU, tiny models) the estimate,
which assumes a new stream costs as much as the average one, would run requests one at a time.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

ADMISSION_POLICIES = ("queue", "reject", "off")
HOLD_LOG_INTERVAL_S = 5.0  # while requests are held, why is logged at most this often
logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionOptions:
    policy: str = "off"
    headroom: float = 0.2  # admit while the estimated load with the new stream is <= 1 - headroom
    max_wait_s: float = 600.0  # the longest a request waits in the queue (then: overloaded)
    window_s: float = 3.0  # how far back the load is measured

    def __post_init__(self) -> None:
        if self.policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission policy {self.policy!r} is not one of {', '.join(ADMISSION_POLICIES)}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"admission headroom {self.headroom} must be in [0, 1)")
        if not self.max_wait_s >= 0 or not self.window_s > 0:
            raise ValueError(f"admission max_wait_s {self.max_wait_s} must be >= 0 and window_s {self.window_s} > 0")


class PlaybackLoad:
    """The rtf of the module docstring, from the audio chunks of the admitted audio requests."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._last_chunk: dict[str, float | None] = {}  # admitted audio requests: their last chunk's time
        self._samples: deque[tuple[float, str, float, float]] = deque()  # (at, key, since previous chunk, seconds)

    @property
    def active(self) -> int:
        return len(self._last_chunk)

    def admitted(self, key: str) -> None:
        self._last_chunk[key] = None

    def finished(self, key: str) -> None:
        self._last_chunk.pop(key, None)

    def chunk(self, key: str, seconds: float) -> None:
        if key not in self._last_chunk or seconds <= 0:
            return
        now, previous = self.clock(), self._last_chunk[key]
        self._last_chunk[key] = now
        if previous is not None:
            self._samples.append((now, key, now - previous, seconds))

    def measured(self) -> tuple[float, int] | None:
        """(rtf: wall seconds per second of audio of one stream, the streams it was measured on)
        over the window; None: nothing measured."""
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        audio = sum(s for _, _, _, s in self._samples)
        if audio <= 0:
            return None
        return sum(t for _, _, t, _ in self._samples) / audio, len({key for _, key, _, _ in self._samples})

    def with_one_more(self) -> float:
        """The load if one more stream started now (0.0: nothing measured, or no stream to protect)."""
        measured = self.measured()
        if measured is None or self.active == 0:
            return 0.0
        rtf, streams = measured
        return rtf * (self.active + 1) / streams


class PlaybackAdmission(Generic[T]):
    """Admits submissions (`start`), holds them (queue) or turns them away (`reject(item, why)`)."""

    def __init__(self, options: AdmissionOptions, start: Callable[[T], str | None],
                 reject: Callable[[T, str], None], call_later: Callable[[float, Callable[[], None]], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`start(item)`: runs it, returning its key (None: it did not start); `call_later(delay,
        fn)`: the event loop's timer (a queued item's deadline)."""
        self.options = options
        self.load = PlaybackLoad(options.window_s, clock)
        self._start, self._reject, self._call_later, self._clock = start, reject, call_later, clock
        self._queue: deque[tuple[T, str, float]] = deque()  # (item, request id, wait deadline)
        self.counters: Counter[str] = Counter()  # queued, refused, max_queue (benchmarks' log_stats)
        self._logged_hold_at = float("-inf")

    @property
    def queued(self) -> int:
        return len(self._queue)

    def fits(self) -> bool:
        return self.load.with_one_more() <= 1.0 - self.options.headroom

    def submit(self, item: T, request_id: str, audio: bool) -> None:
        if not audio or self.options.policy == "off":
            self._start(item)
        elif not self._queue and self.fits():
            self._admit(item)
        elif self.options.policy == "reject":
            self._refuse(item, self._why())
        else:
            self._queue.append((item, request_id, self._clock() + self.options.max_wait_s))
            self.counters["queued"] += 1
            self.counters["max_queue"] = max(self.counters["max_queue"], len(self._queue))
            self._log_hold()
            self._call_later(self.options.max_wait_s, self._expire)
            # The load measured now leaves the window by then: look again even if no chunk comes.
            self._call_later(self.options.window_s, self.drain)

    def is_queued(self, request_id: str) -> bool:
        return any(rid == request_id for _, rid, _ in self._queue)

    def take_first(self) -> T:
        return self._queue.popleft()[0]

    def take(self, request_id: str) -> T | None:
        """Remove a queued request (its caller aborted it); None when it is not queued."""
        for entry in self._queue:
            if entry[1] == request_id:
                self._queue.remove(entry)
                return entry[0]
        return None

    def chunk(self, key: str, seconds: float) -> None:
        self.load.chunk(key, seconds)
        self.drain()

    def finished(self, key: str) -> None:
        self.load.finished(key)
        self.drain()

    def drain(self) -> None:
        while self._queue and self.fits():
            item, _, _ = self._queue.popleft()
            self._admit(item)

    def _admit(self, item: T) -> None:
        key = self._start(item)
        if key is not None:
            self.load.admitted(key)

    def _expire(self) -> None:
        now = self._clock()
        while self._queue and self._queue[0][2] <= now:
            item, _, _ = self._queue.popleft()
            self._refuse(item, f"no room within {self.options.max_wait_s:g} s: " + self._why())

    def _log_hold(self) -> None:
        """An operator (or a benchmark's log) sees that requests wait, and the measurement why."""
        now = self._clock()
        if now - self._logged_hold_at >= HOLD_LOG_INTERVAL_S:
            self._logged_hold_at = now
            measured = self.load.measured()
            rtf = f"{measured[0]:.3f} over {measured[1]} streams" if measured else "nothing measured"
            logger.warning("admission: %d requests queued (%d queued so far); %s; rtf %s", len(self._queue),
                           self.counters["queued"], self._why().split("; retry")[0], rtf)

    def _refuse(self, item: T, why: str) -> None:
        self.counters["refused"] += 1
        self._reject(item, why)

    def _why(self) -> str:
        return (f"the pipeline is at its playback load ({self.load.active} audio streams, estimated load "
                f"{self.load.with_one_more():.2f} with one more, limit {1.0 - self.options.headroom:.2f}); "
                "retry later")
