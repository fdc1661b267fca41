"""Decode videos with PyAV and sample them the way Qwen2.5-Omni expects.

    clip = load_video("clip.mp4", with_audio=True)
    clip.frames        # [T, H, W, 3] uint8, T a multiple of 2, H and W multiples of 28
    clip.sample_fps    # frames per second of the sampled frames (timing for position ids)
    clip.audio         # float32 mono 16 kHz waveform of the audio track, or None

Sampling follows qwen-omni-utils (vision.VideoSampling): `fps` frames per second, clamped to
[min_frames, max_frames], rounded down to a multiple of 2, spread evenly over the video; every
frame is then resized to one smart_resize'd size within the per-frame pixel bounds, as soon as
it is decoded (the source-resolution frames are never held together).

Limits (the policy's DecodeLimits), checked from the stream's header before decoding and again
on every frame as it decodes: a frame's pixels (`max_image_pixels`), the pixels the decoder goes
through (`max_video_pixels`; every frame counts as at least 64x64, so a flood of tiny frames is
bounded too), and the sampled frames after resizing (at most 8 x `max_image_pixels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_omni.multimodal.media import (
    AUDIO_SAMPLE_RATE,
    TRUSTED,
    MediaError,
    MediaPolicy,
    Source,
    _as_file,
    check_pixels,
    decode_audio_av,
    load_image,
    read_source,
    to_mono_resampled,
)
from vllm_omni.multimodal.media_policy import DecodeLimits, MediaBudget
from vllm_omni.multimodal.vision import (
    VideoSampling,
    frame_indices,
    frame_size,
    num_sampled_frames,
    resize_frames,
)


@dataclass
class VideoClip:
    frames: np.ndarray  # [T, H, W, 3] uint8, resized
    sample_fps: float  # rate of the sampled frames: sets the video's time axis
    audio: np.ndarray | None = None  # mono float32 at 16 kHz, when asked for and present
    total_frames: int = 0  # in the source
    source_fps: float = 0.0


MIN_FRAME_COST = 64 * 64  # pixels a frame counts as, however small: each one costs decoder time
SAMPLED_PER_IMAGE_LIMIT = 8  # the sampled frames of a video hold at most this many max_image_pixels


def _work(width: int, height: int) -> int:
    return max(width * height, MIN_FRAME_COST)


def _over_budget(limits: DecodeLimits) -> MediaError:
    return MediaError(f"the video is longer or larger than this server decodes: over {limits.max_video_pixels} frame "
                      "pixels (--max-video-pixels)")


def _count_frames(data, stream_index: int, work: int, limits: DecodeLimits) -> int:
    """Frames of the video stream, counted by demuxing (no decoding): container metadata
    is missing in some formats (webm, mkv) and approximate in others. Stops as soon as the
    frames could not be decoded within the limit."""
    import av

    most = limits.max_video_pixels // work
    with av.open(_as_file(data)) as container:
        stream = container.streams.video[stream_index]
        count = 0
        for packet in container.demux(stream):
            count += packet.size > 0
            if count > most:
                raise _over_budget(limits)
    return count


def sampled_size(height: int, width: int, n: int, sampling: VideoSampling, limits: DecodeLimits) -> tuple[int, int]:
    """The size `n` sampled frames of height x width are resized to, within the limit."""
    h, w = frame_size(height, width, n, sampling)
    most = SAMPLED_PER_IMAGE_LIMIT * limits.max_image_pixels
    if n * h * w > most:
        raise MediaError(f"the video would be sampled to {n} frames of {w}x{h}, over {most} pixels (8 x "
                         "--max-image-pixels); ask for fewer frames or pixels")
    return h, w


class _Sampler:
    """The frames at `wanted` (sorted, may repeat), each resized as soon as it is decoded."""

    def __init__(self, wanted: np.ndarray, sampling: VideoSampling, limits: DecodeLimits) -> None:
        self.wanted, self.sampling, self.limits = wanted, sampling, limits
        self.want = set(int(i) for i in wanted)
        self.picked: dict[int, np.ndarray] = {}
        self.raw_shape: tuple[int, ...] | None = None
        self.size: tuple[int, int] | None = None
        self.decoded_pixels = 0

    def frame(self, index: int, frame) -> None:
        check_pixels(frame.width, frame.height, self.limits, "a video frame")
        self.decoded_pixels += _work(frame.width, frame.height)
        if self.decoded_pixels > self.limits.max_video_pixels:
            raise _over_budget(self.limits)
        if index not in self.want:
            return
        rgb = frame.to_ndarray(format="rgb24")
        if self.size is None:
            self.raw_shape = rgb.shape
            self.size = sampled_size(rgb.shape[0], rgb.shape[1], len(self.wanted), self.sampling, self.limits)
        elif rgb.shape != self.raw_shape:
            raise MediaError(f"cannot decode video: its frames change size ({self.raw_shape} then {rgb.shape})")
        self.picked[index] = resize_frames(rgb[None], *self.size)[0]

    def frames(self) -> list[np.ndarray]:
        return [self.picked[int(i)] for i in self.wanted if int(i) in self.picked]


def _decode_frames(data, wanted: np.ndarray, sampling: VideoSampling,
                   limits: DecodeLimits) -> tuple[list[np.ndarray], int]:
    """The resized frames at `wanted`, and how many frames were seen."""
    import av

    last, seen = int(wanted[-1]), 0
    sampler = _Sampler(wanted, sampling, limits)
    with av.open(_as_file(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for seen, frame in enumerate(container.decode(stream), start=1):
            sampler.frame(seen - 1, frame)
            if seen - 1 >= last:
                break
    return sampler.frames(), seen


def _decode(data, sampling: VideoSampling, limits: DecodeLimits) -> tuple[np.ndarray, float, int, float]:
    import av

    try:
        with av.open(_as_file(data)) as container:
            if not container.streams.video:
                raise MediaError("cannot decode video: the data has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            duration = (
                float(stream.duration * stream.time_base) if stream.duration else
                (container.duration / 1e6 if container.duration else 0.0)
            )
            width, height = stream.codec_context.width, stream.codec_context.height
        check_pixels(width, height, limits, "a video frame")  # the header's size: before any decoding
        total = _count_frames(data, 0, _work(width, height), limits)
        if total == 0:
            raise MediaError("cannot decode video: no frames")
        video_fps = float(rate) if rate else (total / duration if duration > 0 else sampling.fps)
        # The packet count can exceed the decodable frames (a broken tail): sample again from
        # the frames actually decoded rather than silently repeating one.
        for _ in range(2):
            n = num_sampled_frames(total, video_fps, sampling)
            wanted = frame_indices(total, n)
            frames, seen = _decode_frames(data, wanted, sampling, limits)
            if len(frames) == n:
                break
            if seen == 0:
                raise MediaError("cannot decode video: no decodable frames")
            total = seen
        else:
            raise MediaError("cannot decode video: frame count changed while decoding")
    except MediaError:
        raise
    except Exception as e:  # av.error.* (InvalidDataError, ...), bad dimensions, ...
        raise MediaError(f"cannot decode video: {e}") from None
    # qwen-omni-utils: the sampled frames stand for the whole video, so their rate is
    # n / total * source fps (2.0 when fps sampling is exact, more when min_frames kicked in).
    sample_fps = n / max(total, 1e-6) * video_fps
    return np.stack(frames), sample_fps, total, video_fps


def _frames_from_list(items: list[Any], sampling: VideoSampling, policy: MediaPolicy) -> np.ndarray:
    """A video given as its frames (images or HxWx3 arrays): all are kept, padded by repeating
    the last to a multiple of frame_factor (as qwen-omni-utils does for image lists)."""
    frames, pixels, budget = [], 0, MediaBudget(policy)  # the frames named by URLs: one request's items
    for item in items:
        if isinstance(item, str):
            item = read_source(item, policy, "image", budget)
        frame = np.asarray(load_image(item, policy))
        pixels += _work(frame.shape[1], frame.shape[0])
        if pixels > policy.limits.max_video_pixels:
            raise _over_budget(policy.limits)
        frames.append(frame)
    if not frames:
        raise MediaError("a video given as a list of frames needs at least one frame")
    if len({f.shape for f in frames}) != 1:
        raise MediaError("all frames of a video must have the same size")
    frames += [frames[-1]] * (-len(frames) % sampling.frame_factor)
    return np.stack(frames)


def load_video(
    source: Source,
    policy: MediaPolicy = TRUSTED,
    sampling: VideoSampling | None = None,
    with_audio: bool = False,
    frames_fps: float | None = None,
) -> VideoClip:
    """Decode, sample and resize a video; optionally extract its audio track.

    `source`: any media.read_source source (an encoded file: mp4, webm, mkv, ...), a
    [T, H, W, 3] uint8 array or a list of frames (images). Pre-sampled frames are kept as
    they are and timed at `frames_fps` (default: the sampling fps); they carry no audio.
    """
    sampling = sampling or VideoSampling()
    audio = None
    if isinstance(source, (list, np.ndarray)):
        if isinstance(source, np.ndarray) and (source.ndim != 4 or source.dtype != np.uint8):
            raise MediaError(f"video frames must be [T, H, W, 3] uint8, got {source.shape} {source.dtype}")
        frames = _frames_from_list(list(source), sampling, policy)
        sample_fps, total, video_fps = float(frames_fps or sampling.fps), len(frames), 0.0
        if with_audio:
            raise MediaError("a video given as frames has no audio track (use_audio_in_video)")
        frames = resize_frames(frames, *sampled_size(frames.shape[1], frames.shape[2], len(frames), sampling,
                                                     policy.limits))
    else:
        data = read_source(source, policy, "video")
        frames, sample_fps, total, video_fps = _decode(data, sampling, policy.limits)  # resized as decoded
        if with_audio:
            audio = extract_audio(data, policy.limits)
    return VideoClip(frames, sample_fps, audio, total, video_fps)


def extract_audio(data, limits: DecodeLimits, target_sr: int = AUDIO_SAMPLE_RATE) -> np.ndarray | None:
    """The first audio track as float32 mono at target_sr, or None when there is none."""
    try:
        decoded = decode_audio_av(data, limits)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"cannot decode the video's audio track: {e}") from None
    if decoded is None:
        return None
    wave, sr = decoded
    return to_mono_resampled(wave, sr, target_sr)


__all__ = ["VideoClip", "VideoSampling", "extract_audio", "load_video", "read_source"]
