"""Load images and audio from what clients send: objects, bytes, data URLs, http(s) URLs, files.

Every failure raises `MediaError` (a ValueError) with a message fit for an HTTP 400: bad base64,
undecodable bytes, a download that is too big or too slow, a missing or forbidden file.
Videos are in video.py (`load_video` is re-exported here).

    load_image("https://host/cat.png") -> PIL.Image (RGB)
    load_audio("data:audio/wav;base64,...") -> float32 mono waveform at 16 kHz
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

AUDIO_SAMPLE_RATE = 16000  # what Whisper-style audio encoders expect


class MediaError(ValueError):
    """Media that cannot be fetched or decoded (the client's fault: HTTP 400)."""


@dataclass(frozen=True)
class MediaOptions:
    """Limits for fetching media. A server should set `allow_local_files=False` (or confine
    it with `local_root`): otherwise any client can make it read any file it can read."""

    timeout_s: float = 10.0  # for a whole download
    max_bytes: int = 256 * 1024 * 1024
    allow_local_files: bool = True
    local_root: str | None = None  # when set, local files must lie under this folder


DEFAULT_OPTIONS = MediaOptions()

# A source is what a user may pass for one media item: bytes, a path, or a string holding a
# data URL, an http(s) URL, a file:// URL or a path.
Source = Any


def decode_base64(data: str, what: str = "media") -> bytes:
    try:
        # validate=True: reject non-alphabet characters instead of silently dropping them.
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 {what}: {e}") from None


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("invalid data URL: no ',' separating the header from the data")
    if header.endswith(";base64"):
        return decode_base64(payload, "data URL")
    return urllib.parse.unquote_to_bytes(payload)


def _fetch_http(url: str, options: MediaOptions) -> bytes:
    import httpx

    chunks, size = [], 0
    # httpx's timeout bounds each network wait; the deadline bounds the whole download (a
    # server dripping bytes would otherwise hold the request forever).
    deadline = time.monotonic() + options.timeout_s
    try:
        with httpx.stream("GET", url, timeout=options.timeout_s, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise MediaError(f"fetching {url} failed: HTTP {resp.status_code}")
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > options.max_bytes:
                raise MediaError(f"{url} is {declared} bytes, over the {options.max_bytes} limit")
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > options.max_bytes:  # the header can lie or be absent
                    raise MediaError(f"{url} is over the {options.max_bytes} byte limit")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("download deadline passed")
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise MediaError(f"fetching {url} timed out after {options.timeout_s} s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching {url} failed: {e}") from None
    return b"".join(chunks)


def _local_path(path: Path, options: MediaOptions) -> Path:
    if not options.allow_local_files:
        raise MediaError("local file paths are not allowed here; send a URL or base64 data")
    try:
        path = path.expanduser().resolve()
        if options.local_root is not None:
            root = Path(options.local_root).expanduser().resolve()
            if not path.is_relative_to(root):
                raise MediaError(f"{path} is outside the allowed media folder")
        if not path.is_file():
            raise MediaError(f"no such file: {path}")
    except OSError as e:  # e.g. a base64 blob sent without its "data:" prefix: name too long
        raise MediaError(f"not a URL, data URL or readable file: {e.strerror}") from None
    return path


def read_source(source: Source, options: MediaOptions = DEFAULT_OPTIONS) -> bytes | Path:
    """Bytes for in-memory and remote sources, a checked Path for local files (decoders read
    files directly: no copy of a large video into memory)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, Path):
        return _local_path(source, options)
    if not isinstance(source, str):
        raise MediaError(f"unsupported media source type {type(source).__name__}")
    if source.startswith("data:"):
        return _decode_data_url(source)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch_http(source, options)
    if scheme == "file":
        return _local_path(Path(urllib.parse.unquote(urllib.parse.urlsplit(source).path)), options)
    if scheme and len(scheme) > 1:  # "c:" is a Windows drive, not a scheme
        raise MediaError(f"unsupported URL scheme {scheme!r}; use http(s), data or file")
    return _local_path(Path(source), options)


def _as_file(data: bytes | Path):
    return io.BytesIO(data) if isinstance(data, bytes) else data


# ---------------------------------------------------------------------------------- images


def to_rgb(image) -> Any:
    """RGB PIL image; transparency is composited on white (as transformers' convert_to_rgb and
    qwen-vl-utils do, so both pipelines see the same pixels)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "P", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: Source, options: MediaOptions = DEFAULT_OPTIONS):
    """A PIL image in RGB from a PIL image, an HxWx3 uint8 array, or any `read_source` source."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] not in (3, 4) or source.dtype != np.uint8:
            raise MediaError(f"an image array must be HxWx3 uint8, got {source.shape} {source.dtype}")
        return to_rgb(Image.fromarray(source))
    data = read_source(source, options)
    try:
        image = Image.open(_as_file(data))
        image.load()  # decode now: a truncated file must fail here, not in the processor
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"cannot decode image: {e}") from None
    return to_rgb(image)


# ----------------------------------------------------------------------------------- audio


def to_mono_resampled(wave: np.ndarray, sr: int, target_sr: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """[channels, samples], [samples, channels] or [samples] float -> float32 mono at target_sr.

    Channel mean then soxr "HQ": what librosa.load(sr=16000) does (the reference pipeline),
    without librosa's slow first-call warm-up.
    """
    import soxr

    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 2:
        # librosa/torchaudio give [channels, samples], soundfile [samples, channels]; there
        # are always far fewer channels than samples.
        wave = wave.mean(axis=0 if wave.shape[0] <= wave.shape[1] else 1)
    if wave.ndim != 1:
        raise MediaError(f"audio must be 1-D or [channels, samples], got shape {wave.shape}")
    if wave.size == 0:
        raise MediaError("audio is empty")
    if not np.isfinite(wave).all():
        raise MediaError("audio contains NaN or infinite samples")
    if sr != target_sr:
        wave = soxr.resample(wave, sr, target_sr, quality="HQ")
    return np.ascontiguousarray(wave, dtype=np.float32)


def decode_audio_av(data: bytes | Path, stream_index: int = 0) -> tuple[np.ndarray, int] | None:
    """Decode an audio stream with PyAV (FFmpeg): -> ([channels, samples] float32, rate), or
    None when the container has no audio stream. Covers what libsndfile cannot: aac, m4a,
    webm/opus, and the audio track of a video."""
    import av

    with av.open(_as_file(data)) as container:
        if len(container.streams.audio) <= stream_index:
            return None
        stream = container.streams.audio[stream_index]
        # Planar float keeps each channel a row, whatever the codec's native sample format.
        resampler = av.AudioResampler(format="fltp")
        parts, rate = [], stream.rate
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray())
                rate = out.rate
        for out in resampler.resample(None):  # flush
            parts.append(out.to_ndarray())
    if not parts:
        raise MediaError("the audio stream has no decodable samples")
    return np.concatenate(parts, axis=1), int(rate)


def _decode_audio_bytes(data: bytes | Path) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:  # libsndfile: wav, flac, ogg/vorbis, mp3 (libsndfile >= 1.1)
        wave, sr = sf.read(_as_file(data), dtype="float32", always_2d=True)
        return wave.T, int(sr)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as sf_error:
        first_error = sf_error
    try:
        decoded = decode_audio_av(data)
    except Exception as e:  # av raises its own error types (InvalidDataError, ...)
        raise MediaError(f"cannot decode audio: {first_error}; ffmpeg: {e}") from None
    if decoded is None:
        raise MediaError("cannot decode audio: the data has no audio stream")
    return decoded


def load_audio(
    source: Source, options: MediaOptions = DEFAULT_OPTIONS, target_sr: int = AUDIO_SAMPLE_RATE
) -> np.ndarray:
    """A float32 mono waveform at `target_sr`.

    `source`: a `(waveform, sample_rate)` tuple; a bare array or tensor (taken to be at
    `target_sr` already; 2-D is multichannel, either layout); or any `read_source` source holding
    an encoded file (wav, flac, ogg, mp3, and whatever FFmpeg decodes).
    """
    if isinstance(source, tuple) and len(source) == 2:
        wave, sr = source
        return to_mono_resampled(_as_array(wave), int(sr), target_sr)
    if isinstance(source, np.ndarray) or _is_tensor(source):
        return to_mono_resampled(_as_array(source), target_sr, target_sr)
    wave, sr = _decode_audio_bytes(read_source(source, options))
    return to_mono_resampled(wave, sr, target_sr)


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def _as_array(x: Any) -> np.ndarray:
    if _is_tensor(x):
        x = x.detach().cpu().float().numpy()
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.number):
        raise MediaError(f"audio samples must be a numeric array, got {type(x).__name__}")
    if np.issubdtype(x.dtype, np.integer):  # PCM integers -> [-1, 1) like soundfile does
        x = x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
    return x


def load_video(source: Source, options: MediaOptions = DEFAULT_OPTIONS, **kwargs):
    """See vllm_omni.multimodal.video.load_video."""
    from vllm_omni.multimodal.video import load_video as _load_video

    return _load_video(source, options, **kwargs)
