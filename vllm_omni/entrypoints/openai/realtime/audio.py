"""Audio on the realtime socket: what the client sends in, what the model hears, what goes out.

    stream = InputAudioStream(AudioFormat("audio/pcm", 24000))
    samples = stream.decode(b64)          # float32 at 16 kHz (what the thinker's encoder takes)
    tail = stream.flush()                 # the resampler's last samples, at a commit
    pcm16_b64(wave_24k)                   # a response.output_audio.delta payload

Input: `audio/pcm` is 16-bit little-endian mono at the rate the session declares (OpenAI
allows only 24000; we take any rate in [8000, 48000] and resample), `audio/pcmu` and
`audio/pcma` are G.711 at 8 kHz. One soxr stream per session resamples chunk by chunk, so a
turn sent in many appends gives the model the same samples as one big append.
Output: PCM16 at 24 kHz, the sample rate of both omni families' vocoders.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np
import soxr

from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE, encode_audio
from vllm_omni.multimodal.media import AUDIO_SAMPLE_RATE

MODEL_RATE = AUDIO_SAMPLE_RATE  # 16 kHz: the thinker's (Whisper-style) audio encoder
MIN_RATE, MAX_RATE = 8000, 48000
G711_RATE = 8000
INPUT_TYPES = ("audio/pcm", "audio/pcmu", "audio/pcma")


class AudioDecodeError(ValueError):
    """Bad audio bytes from the client (the session answers with an `error` event)."""


@dataclass(frozen=True)
class AudioFormat:
    type: str = "audio/pcm"
    rate: int = OUTPUT_SAMPLE_RATE

    def __post_init__(self) -> None:
        if self.type not in INPUT_TYPES:
            raise ValueError(f"unsupported audio format {self.type!r}; use one of {list(INPUT_TYPES)}")
        if self.type != "audio/pcm" and self.rate != G711_RATE:
            raise ValueError(f"{self.type} is G.711 at {G711_RATE} Hz")
        if not MIN_RATE <= self.rate <= MAX_RATE:
            raise ValueError(f"audio rate must be within [{MIN_RATE}, {MAX_RATE}] Hz, got {self.rate}")

    def wire(self) -> dict[str, object]:
        return {"type": self.type, "rate": self.rate} if self.type == "audio/pcm" else {"type": self.type}


def _ulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    magnitude = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - magnitude, magnitude - 0x84).astype(np.float32) / 32768.0


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    mant = (a & 0x0F) << 4
    magnitude = np.where(seg == 0, mant + 8, (mant + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, magnitude, -magnitude).astype(np.float32) / 32768.0


_G711 = {"audio/pcmu": _ulaw_table(), "audio/pcma": _alaw_table()}


def decode_b64(data: object) -> bytes:
    if not isinstance(data, str):
        raise AudioDecodeError("audio must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise AudioDecodeError(f"audio is not valid base64: {e}") from None


def to_float(raw: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes -> float32 samples at the format's rate."""
    if fmt.type == "audio/pcm":
        if len(raw) % 2:
            raise AudioDecodeError(f"audio/pcm is 16-bit: {len(raw)} bytes is not a whole number of samples")
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return _G711[fmt.type][np.frombuffer(raw, dtype=np.uint8)]


def model_samples(b64_chars: int, fmt: AudioFormat) -> int:
    """About how many 16 kHz samples `b64_chars` of base64 audio decode to: checked against the
    limits before any decoding."""
    raw = b64_chars * 3 // 4
    samples = raw // 2 if fmt.type == "audio/pcm" else raw
    return samples * MODEL_RATE // fmt.rate


class InputAudioStream:
    """One session's input: wire chunks -> float32 at 16 kHz, continuous across appends."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resampler = self._new_resampler()

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.format.rate == MODEL_RATE:
            return None
        return soxr.ResampleStream(self.format.rate, MODEL_RATE, 1, dtype="float32", quality="HQ")

    def decode(self, data: object) -> np.ndarray:
        wave = to_float(decode_b64(data), self.format)
        if self._resampler is None:
            return wave
        return self._resampler.resample_chunk(wave)

    def flush(self) -> np.ndarray:
        """The samples the resampler still holds (its filter delay); the next chunk starts afresh."""
        if self._resampler is None:
            return np.zeros(0, np.float32)
        tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        self._resampler = self._new_resampler()
        return tail


def pcm16_b64(wave: np.ndarray) -> str:
    return base64.b64encode(encode_audio(wave, OUTPUT_SAMPLE_RATE, "pcm16")).decode("ascii")


def samples_to_ms(n: int, rate: int) -> int:
    return int(n * 1000 // rate)
