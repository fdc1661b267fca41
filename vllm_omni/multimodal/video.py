"""Decode videos with PyAV and sample them the way Qwen2.5-Omni expects.

    clip = load_video("clip.mp4", with_audio=True)
    clip.frames        # [T, H, W, 3] uint8, T a multiple of 2, H and W multiples of 28
    clip.sample_fps    # frames per second of the sampled frames (timing for position ids)
    clip.audio         # float32 mono 16 kHz waveform of the audio track, or None

Sampling follows qwen-omni-utils (vision.VideoSampling): `fps` frames per second, clamped to
[min_frames, max_frames], rounded down to a multiple of 2, spread evenly over the video; every
frame is then resized to one smart_resize'd size within the per-frame pixel bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_omni.multimodal.media import (
    AUDIO_SAMPLE_RATE,
    DEFAULT_OPTIONS,
    MediaError,
    MediaOptions,
    Source,
    _as_file,
    decode_audio_av,
    load_image,
    read_source,
    to_mono_resampled,
)
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


def _count_frames(data, stream_index: int) -> int:
    """Frames of the video stream, counted by demuxing (no decoding): container metadata
    is missing in some formats (webm, mkv) and approximate in others."""
    import av

    with av.open(_as_file(data)) as container:
        stream = container.streams.video[stream_index]
        return sum(1 for packet in container.demux(stream) if packet.size > 0)


def _decode_frames(data, wanted: np.ndarray) -> tuple[list[np.ndarray], int]:
    """RGB arrays of the frames at `wanted` (sorted, may repeat), and how many frames were seen."""
    import av

    want = set(int(i) for i in wanted)
    last, picked, seen = int(wanted[-1]), {}, 0
    with av.open(_as_file(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for seen, frame in enumerate(container.decode(stream), start=1):
            index = seen - 1
            if index in want:
                picked[index] = frame.to_ndarray(format="rgb24")
            if index >= last:
                break
    return [picked[int(i)] for i in wanted if int(i) in picked], seen


def _decode(data, sampling: VideoSampling) -> tuple[np.ndarray, float, int, float]:
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
        total = _count_frames(data, 0)
        if total == 0:
            raise MediaError("cannot decode video: no frames")
        video_fps = float(rate) if rate else (total / duration if duration > 0 else sampling.fps)
        # The packet count can exceed the decodable frames (a broken tail): sample again from
        # the frames actually decoded rather than silently repeating one.
        for _ in range(2):
            n = num_sampled_frames(total, video_fps, sampling)
            wanted = frame_indices(total, n)
            frames, seen = _decode_frames(data, wanted)
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


def _frames_from_list(items: list[Any], sampling: VideoSampling, options) -> np.ndarray:
    """A video given as its frames (images or HxWx3 arrays): all are kept, padded by repeating
    the last to a multiple of frame_factor (as qwen-omni-utils does for image lists)."""
    frames = [np.asarray(load_image(x, options)) for x in items]
    if not frames:
        raise MediaError("a video given as a list of frames needs at least one frame")
    if len({f.shape for f in frames}) != 1:
        raise MediaError("all frames of a video must have the same size")
    frames += [frames[-1]] * (-len(frames) % sampling.frame_factor)
    return np.stack(frames)


def load_video(
    source: Source,
    options: MediaOptions = DEFAULT_OPTIONS,
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
        frames = _frames_from_list(list(source), sampling, options)
        sample_fps, total, video_fps = float(frames_fps or sampling.fps), len(frames), 0.0
        if with_audio:
            raise MediaError("a video given as frames has no audio track (use_audio_in_video)")
    else:
        data = read_source(source, options)
        frames, sample_fps, total, video_fps = _decode(data, sampling)
        if with_audio:
            audio = extract_audio(data)
    height, width = frame_size(frames.shape[1], frames.shape[2], len(frames), sampling)
    frames = resize_frames(frames, height, width)
    return VideoClip(frames, sample_fps, audio, total, video_fps)


def extract_audio(data, target_sr: int = AUDIO_SAMPLE_RATE) -> np.ndarray | None:
    """The first audio track as float32 mono at target_sr, or None when there is none."""
    try:
        decoded = decode_audio_av(data)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"cannot decode the video's audio track: {e}") from None
    if decoded is None:
        return None
    wave, sr = decoded
    return to_mono_resampled(wave, sr, target_sr)


__all__ = ["VideoClip", "VideoSampling", "extract_audio", "load_video", "read_source"]
