"""The input audio buffer: audio appended but not yet committed as a user turn.

Positions are absolute sample indices (16 kHz) on the session's audio timeline, which counts
every sample ever appended; `audio_start_ms` / `audio_end_ms` of the VAD events are read off
it, as in OpenAI's API. Without VAD the buffer holds everything since the last commit or
clear. With VAD it holds only `prefix_padding_ms` of audio before speech (older silence is
dropped, so a silent open microphone costs no memory) and then the speech until it stops.
"""
from __future__ import annotations

import numpy as np

from vllm_omni.entrypoints.openai.realtime.vad import FRAME, SAMPLE_RATE


class BufferFull(ValueError):
    pass


class InputBuffer:
    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self.start = 0  # timeline index of the first buffered sample
        self.end = 0  # timeline index after the last appended sample
        self._chunks: list[np.ndarray] = []
        self.vad_done = 0  # timeline index up to which the VAD has seen whole frames

    def __len__(self) -> int:
        return self.end - self.start

    def check_room(self, n: int) -> None:
        """BufferFull unless `n` more samples fit."""
        if len(self) + n > self.max_samples:
            raise BufferFull(f"the input audio buffer would hold {(len(self) + n) / SAMPLE_RATE:.1f} s "
                             f"of audio, over the {self.max_samples / SAMPLE_RATE:.0f} s limit; commit or clear it")

    def append(self, samples: np.ndarray) -> None:
        self.check_room(samples.size)
        if samples.size:
            self._chunks.append(samples.astype(np.float32, copy=False))
            self.end += samples.size

    def samples(self) -> np.ndarray:
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)]
        return self._chunks[0]

    def pending_frames(self) -> np.ndarray:
        """Whole frames the VAD has not seen yet (marked seen)."""
        n = (self.end - self.vad_done) // FRAME * FRAME
        first = self.vad_done - self.start
        self.vad_done += n
        return self.samples()[first:first + n]

    def take(self, upto: int | None = None) -> np.ndarray:
        """Remove and return the audio before timeline index `upto` (None: all of it)."""
        upto = self.end if upto is None else upto
        data = self.samples()
        cut = max(0, upto - self.start)
        head, rest = data[:cut], data[cut:]
        self._chunks = [rest] if rest.size else []
        self.start += cut
        self.vad_done = max(self.vad_done, self.start)
        return head

    def clear(self) -> None:
        self.take()

    def drop_before(self, index: int) -> None:
        """Forget silence: keep only the audio from timeline index `index` on."""
        if index > self.start:
            self.take(index)
