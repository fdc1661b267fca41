"""Audio helpers of POST /v1/audio/speech: speed change, encoding, streaming WAV.

- `change_speed`: FFmpeg's `atempo` filter (through PyAV): tempo changes, pitch stays. One
  atempo stage spans 0.5-2.0, so 0.25-4.0 (OpenAI's range) chains two.
- `encode_speech`: one OpenAI response_format -> a complete file (pcm: raw 16-bit LE).
- `wav_stream_header`: a WAV header for a stream of unknown length (sizes 0xFFFFFFFF, the
  convention players accept), followed by raw 16-bit PCM chunks.
"""
from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np

from vllm_omni.entrypoints.openai.audio import MEDIA_TYPES, encode_audio

# OpenAI response_format -> our encoder's name
_ENCODER_FORMAT = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm": "pcm16"}
SPEECH_MEDIA_TYPES = {fmt: MEDIA_TYPES[enc] for fmt, enc in _ENCODER_FORMAT.items()}
STREAMABLE_FORMATS = ("pcm", "wav")  # formats whose chunks concatenate into one playable stream


def encoder_format(response_format: str) -> str:
    return _ENCODER_FORMAT[response_format]


def encode_speech(wave: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    return encode_audio(wave, sample_rate, _ENCODER_FORMAT[response_format])


def pcm16(wave: np.ndarray) -> bytes:
    return encode_audio(wave, 0, "pcm16")


def wav_stream_header(sample_rate: int) -> bytes:
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)  # PCM, mono, 16-bit
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", unknown))


def _atempo_factors(speed: float) -> list[float]:
    factors = []
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return [*factors, speed]


def change_speed(wave: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """[n] float32 -> about [n / speed] float32, same pitch."""
    if speed == 1.0 or wave.size == 0:
        return wave
    import av
    import av.filter

    graph = av.filter.Graph()
    nodes = [graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono",
                               time_base=Fraction(1, sample_rate))]
    nodes += [graph.add("atempo", f"{factor}") for factor in _atempo_factors(speed)]
    nodes.append(graph.add("abuffersink"))
    for a, b in zip(nodes, nodes[1:]):
        a.link_to(b)
    graph.configure()
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave, dtype=np.float32)[None, :], format="flt",
                                       layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
    graph.push(frame)
    graph.push(None)  # end of stream: the filter flushes what it holds
    out = []
    while True:
        try:
            out.append(graph.pull().to_ndarray().reshape(-1))
        except (av.error.EOFError, av.error.BlockingIOError):
            break
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
