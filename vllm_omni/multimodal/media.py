"""Load images and audio from what clients send: objects, bytes, data URLs, http(s) URLs, files.

Every failure raises `MediaError` (a ValueError) with a message fit for an HTTP 400: bad base64,
undecodable bytes, a download that is too big or too slow, a missing or forbidden file, media
over a decode limit. Sources are read through the media gate (media_fetch.py) under a
`MediaPolicy` (TRUSTED by default: the offline APIs' caller names its own files); decoding stops
at the policy's `DecodeLimits` while it runs. Videos are in video.py (`load_video` is
re-exported here).

    load_image("https://host/cat.png") -> PIL.Image (RGB)
    load_audio("data:audio/wav;base64,...") -> float32 mono waveform at 16 kHz
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni.multimodal.media_fetch import decode_base64, fetch_blocking, local_file
from vllm_omni.multimodal.media_policy import TRUSTED, DecodeLimits, MediaBudget, MediaError, MediaPolicy

AUDIO_SAMPLE_RATE = 16000  # what Whisper-style audio encoders expect
# Formats an image may be in; others (EPS runs Ghostscript, ...) are never opened.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG covers MPO (phone photos)
_AUDIO_BLOCK = 65536  # samples decoded at a time: the length limit is checked per block

# A source is what a user may pass for one media item: bytes, a path, or a string holding a
# data URL, an http(s) URL, a file:// URL or a path.
Source = Any

__all__ = ["AUDIO_SAMPLE_RATE", "MediaError", "MediaPolicy", "TRUSTED", "decode_base64", "load_audio",
           "load_image", "load_video", "read_source"]


def read_source(source: Source, policy: MediaPolicy = TRUSTED, kind: str = "media",
                budget: MediaBudget | None = None) -> bytes | Path:
    """Bytes for in-memory and remote sources, a checked Path for local files (decoders read
    files directly: no copy of a large video into memory). `kind` ("image", "audio", "video")
    is what a data URL's MIME type must say."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, Path):
        return local_file(source, source, policy)
    if not isinstance(source, str):
        raise MediaError(f"unsupported media source type {type(source).__name__}")
    return fetch_blocking(source, kind, policy, budget)


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


def check_pixels(width: int, height: int, limits: DecodeLimits, what: str = "the image") -> None:
    if width * height > limits.max_image_pixels:
        raise MediaError(f"{what} is {width}x{height} ({width * height} pixels), over the {limits.max_image_pixels} "
                         "pixel limit (--max-image-pixels)")


def open_image(data: bytes | Path, limits: DecodeLimits):
    """An encoded image opened lazily: its header read and its size checked, no pixel decoded."""
    from PIL import Image

    try:
        image = Image.open(_as_file(data), formats=IMAGE_FORMATS)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"cannot decode image: {e}") from None
    check_pixels(*image.size, limits)
    return image


def load_image(source: Source, policy: MediaPolicy = TRUSTED):
    """A PIL image in RGB from a PIL image, an HxWx3 uint8 array, or any `read_source` source.
    An encoded image's size is read from its header and checked before any pixel is decoded."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] not in (3, 4) or source.dtype != np.uint8:
            raise MediaError(f"an image array must be HxWx3 uint8, got {source.shape} {source.dtype}")
        return to_rgb(Image.fromarray(source))
    image = open_image(read_source(source, policy, "image"), policy.limits)
    try:
        image.load()  # decode now: a truncated file must fail here, not in the processor
    except (OSError, SyntaxError, ValueError) as e:
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


class _Samples:
    """Mono blocks of one decoding, counted against the duration limit as they arrive."""

    def __init__(self, rate: int, limits: DecodeLimits) -> None:
        if not 0 < rate <= limits.max_audio_rate:
            raise MediaError(f"unsupported audio sample rate {rate} Hz (at most {limits.max_audio_rate})")
        self.rate, self.limits = rate, limits
        self.max_samples = int(limits.max_audio_s * rate)
        self.blocks: list[np.ndarray] = []
        self.count = 0

    def add(self, channels_first: np.ndarray) -> None:
        """A decoded block, [channels, samples]: downmixed at once (the same channel mean as
        to_mono_resampled), so memory holds one channel."""
        self.count += channels_first.shape[1]
        if self.count > self.max_samples:
            raise MediaError(f"the audio is longer than {self.limits.max_audio_s:g} s, this server's limit "
                             f"({self.limits.max_audio_s_flag})")
        self.blocks.append(channels_first.mean(axis=0))

    def wave(self) -> tuple[np.ndarray, int]:
        if not self.blocks:
            raise MediaError("the audio stream has no decodable samples")
        return np.concatenate(self.blocks), self.rate


def decode_audio_av(data: bytes | Path, limits: DecodeLimits, stream_index: int = 0) -> tuple[np.ndarray, int] | None:
    """Decode an audio stream with PyAV (FFmpeg), stopping at the duration limit: -> (mono
    float32, rate), or None when the container has no audio stream. Covers what libsndfile
    cannot: aac, m4a, webm/opus, and the audio track of a video."""
    import av

    with av.open(_as_file(data)) as container:
        if len(container.streams.audio) <= stream_index:
            return None
        stream = container.streams.audio[stream_index]
        # Planar float keeps each channel a row, whatever the codec's native sample format.
        resampler = av.AudioResampler(format="fltp")
        samples = None
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                samples = samples or _Samples(int(out.rate), limits)
                samples.add(out.to_ndarray())
        for out in resampler.resample(None):  # flush
            samples = samples or _Samples(int(out.rate), limits)
            samples.add(out.to_ndarray())
    if samples is None:
        raise MediaError("the audio stream has no decodable samples")
    return samples.wave()


def _decode_soundfile(data: bytes | Path, limits: DecodeLimits) -> tuple[np.ndarray, int]:
    import soundfile as sf

    with sf.SoundFile(_as_file(data)) as f:
        samples = _Samples(int(f.samplerate), limits)
        for block in f.blocks(blocksize=_AUDIO_BLOCK, dtype="float32", always_2d=True):
            samples.add(block.T)
    return samples.wave()


def _decode_audio_bytes(data: bytes | Path, limits: DecodeLimits) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:  # libsndfile: wav, flac, ogg/vorbis, mp3 (libsndfile >= 1.1)
        return _decode_soundfile(data, limits)
    except MediaError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as sf_error:
        first_error = sf_error
    try:
        decoded = decode_audio_av(data, limits)
    except MediaError:
        raise
    except Exception as e:  # av raises its own error types (InvalidDataError, ...)
        raise MediaError(f"cannot decode audio: {first_error}; ffmpeg: {e}") from None
    if decoded is None:
        raise MediaError("cannot decode audio: the data has no audio stream")
    return decoded


def load_audio(source: Source, policy: MediaPolicy = TRUSTED, target_sr: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
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
    wave, sr = _decode_audio_bytes(read_source(source, policy, "audio"), policy.limits)
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


def load_video(source: Source, policy: MediaPolicy = TRUSTED, **kwargs):
    """See vllm_omni.multimodal.video.load_video."""
    from vllm_omni.multimodal.video import load_video as _load_video

    return _load_video(source, policy, **kwargs)
