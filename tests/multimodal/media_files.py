"""Test media made on the fly: sine waves via soundfile, images via PIL, mp4 via PyAV."""

from __future__ import annotations

import functools
import io

import numpy as np


def sine(seconds: float, sr: int, channels: int = 1, freq: float = 440.0) -> np.ndarray:
    """[samples, channels] float32; channel c at freq * (c + 1) so a downmix is not trivial."""
    t = np.arange(int(seconds * sr)) / sr
    waves = [0.4 * np.sin(2 * np.pi * freq * (c + 1) * t) for c in range(channels)]
    return np.stack(waves, 1).astype(np.float32)


def audio_bytes(fmt: str, seconds: float = 1.0, sr: int = 44100, channels: int = 2) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}[fmt]
    sf.write(buf, sine(seconds, sr, channels), sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def image_bytes(
    fmt: str = "PNG", size: tuple[int, int] = (90, 60), mode: str = "RGB", seed: int = 0
) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    array = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format=fmt)
    return buf.getvalue()


def mp4_bytes(
    n_frames: int = 25, fps: int = 10, size: tuple[int, int] = (48, 64), with_audio: bool = False,
    audio_sr: int = 44100, container: str = "mp4",
) -> bytes:
    """Frame i is a flat gray of value 10 * i (lossless x264), so tests can tell which frames
    were sampled. The audio track (aac, stereo) lasts as long as the video."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as c:
        vs = c.add_stream("libx264", rate=fps)
        vs.height, vs.width = size
        vs.pix_fmt = "yuv420p"
        vs.options = {"preset": "ultrafast", "qp": "0"}
        if with_audio:
            astream = c.add_stream("aac", rate=audio_sr)
            astream.layout = "stereo"
        for i in range(n_frames):
            frame = np.full((*size, 3), (10 * i) % 256, dtype=np.uint8)
            for packet in vs.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(packet)
        for packet in vs.encode(None):
            c.mux(packet)
        if with_audio:
            wave = sine(n_frames / fps, audio_sr, 2).T.copy()
            aframe = av.AudioFrame.from_ndarray(wave, format="fltp", layout="stereo")
            aframe.sample_rate = audio_sr
            for packet in [*astream.encode(aframe), *astream.encode(None)]:
                c.mux(packet)
    return buf.getvalue()


def m4a_bytes(seconds: float = 1.0, sr: int = 44100) -> bytes:
    """AAC audio in an mp4 container: libsndfile cannot read it, FFmpeg (PyAV) can."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        stream = c.add_stream("aac", rate=sr)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(sine(seconds, sr, 1).T.copy(), format="fltp", layout="mono")
        frame.sample_rate = sr
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            c.mux(packet)
    return buf.getvalue()


@functools.lru_cache(maxsize=None)  # built once per test run (a second or so each)
def flac_bomb(hours: float = 3.0, sr: int = 8000) -> bytes:
    """A FLAC of silence: a few hundred kilobytes that decode to `hours` of audio."""
    import soundfile as sf

    buf, block = io.BytesIO(), np.zeros(sr * 60, dtype=np.int16)
    with sf.SoundFile(buf, "w", samplerate=sr, channels=1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(int(hours * 60)):
            f.write(block)
    return buf.getvalue()


@functools.lru_cache(maxsize=None)
def png_bomb(width: int, height: int) -> bytes:
    """A valid black RGB PNG of width x height, built row by row (never held decoded): about
    a thousandth of its decoded size."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, row = zlib.compressobj(9), b"\0" * (1 + 3 * width)  # filter byte + RGB
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
