"""Synthetic test audio: a speech-like signal (a voiced source through moving vowel formants,
with syllable-rate loudness), silence, and the wire encodings of the realtime API."""
from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf

# First three formants (Hz) of a few vowels: /a/, /i/, /u/, /e/, /o/.
_VOWELS = np.array([[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]])


def speech_like(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    f0 = (115 + 20 * rng.random()) * (1 + 0.06 * np.sin(2 * np.pi * 3 * t))  # pitch with vibrato
    phase = np.cumsum(2 * np.pi * f0 / sr)
    formants = _VOWELS[(np.arange(n) // int(0.18 * sr) + seed) % len(_VOWELS)]  # a new vowel every 180 ms
    wave = np.zeros(n)
    for h in range(1, 40):
        freq = h * f0
        gain = sum(1.0 / (1.0 + ((freq - formants[:, k]) / 90.0) ** 2) for k in range(3))
        wave += gain * np.sin(h * phase) / np.sqrt(h)
    syllables = 0.35 + 0.65 * np.sin(np.pi * 4 * t) ** 2  # ~4 syllables a second
    wave = wave * syllables + 0.02 * rng.standard_normal(n)
    return (0.4 * wave / np.abs(wave).max()).astype(np.float32)


def silence(seconds: float, sr: int, seed: int = 1) -> np.ndarray:
    """A quiet room: faint noise, not digital zeros."""
    return (0.002 * np.random.default_rng(seed).standard_normal(int(seconds * sr))).astype(np.float32)


def pcm16(wave: np.ndarray) -> np.ndarray:
    return np.clip(np.round(wave * 32767), -32768, 32767).astype("<i2")


def pcm16_b64(wave: np.ndarray) -> str:
    return base64.b64encode(pcm16(wave).tobytes()).decode("ascii")


def wav_b64(wave: np.ndarray, sr: int) -> str:
    """The same int16 samples as pcm16_b64, in a wav file (for the chat API's input_audio)."""
    buf = io.BytesIO()
    sf.write(buf, pcm16(wave), sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode("ascii")
