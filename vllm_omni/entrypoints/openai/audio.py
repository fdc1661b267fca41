"""Encode generated speech for the API: wav, flac, pcm16, mp3, opus, aac.

    encode_audio(wave_f32, 24000, "wav") -> bytes of a complete file

wav and flac are 16-bit PCM written by libsndfile (what players and OpenAI's API expect);
pcm16 is raw little-endian 16-bit mono with no header, so streamed chunks concatenate into one
stream. mp3, opus and aac go through PyAV (FFmpeg) when its build has the encoder; otherwise the
request is refused with a 400 before any generation starts (`check_format`).
Each streamed chunk is encoded on its own: a complete file per chunk (a bare run of samples
for pcm16), which a client decodes and appends.
"""
from __future__ import annotations

import functools
import io

import numpy as np

from vllm_omni.entrypoints.openai.errors import APIError

OUTPUT_SAMPLE_RATE = 24000  # Qwen2.5-Omni's token2wav rate (contract: float32 at 24 kHz)

# format -> (PyAV container, encoder) for the formats libsndfile does not write.
_AV_FORMATS = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac")}
_SF_FORMATS = {"wav": "WAV", "flac": "FLAC"}
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "pcm16": "audio/pcm", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "aac": "audio/aac"}


@functools.cache
def _has_encoder(name: str) -> bool:
    import av

    try:
        av.codec.Codec(name, "w")
    except Exception:  # noqa: BLE001 - av raises UnknownCodecError or a plain ValueError by version
        return False
    return True


def check_format(fmt: str) -> None:
    """Raise a 400 for a format this server cannot produce (checked before generating)."""
    if fmt in _SF_FORMATS or fmt == "pcm16":
        return
    if fmt not in _AV_FORMATS:
        raise APIError(400, f"unsupported audio format {fmt!r}; use one of {sorted(MEDIA_TYPES)}", param="audio.format")
    encoder = _AV_FORMATS[fmt][1]
    if not _has_encoder(encoder):
        raise APIError(400, f"audio format {fmt!r} needs the FFmpeg encoder {encoder!r}, which this server's "
                            "PyAV build lacks; use wav, flac or pcm16", param="audio.format")


def encode_audio(wave: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    wave = np.ascontiguousarray(np.asarray(wave, dtype=np.float32).reshape(-1))
    if fmt == "pcm16":
        # The scaling and rounding libsndfile uses for float -> PCM_16 (measured: x * 32768,
        # rounded down, clipped), so pcm16 and wav of one waveform hold the same samples.
        return np.clip(np.floor(wave * 32768.0), -32768, 32767).astype("<i2").tobytes()
    if fmt in _SF_FORMATS:
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, wave, sample_rate, format=_SF_FORMATS[fmt], subtype="PCM_16")
        return buf.getvalue()
    check_format(fmt)
    container, encoder = _AV_FORMATS[fmt]
    return _encode_av(wave, sample_rate, container, encoder)


def _encode_av(wave: np.ndarray, sample_rate: int, container: str, encoder: str) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(encoder, rate=sample_rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(wave[None, :], format="flt", layout="mono")
        frame.sample_rate = sample_rate
        # The encoder re-frames and converts the sample format itself; None flushes it.
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
