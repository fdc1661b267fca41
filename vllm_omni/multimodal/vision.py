"""Qwen2-VL style vision math, no IO: frame counts, per-frame resizing and video patchification.

The numbers follow qwen-omni-utils (what the released Qwen2.5-Omni was served with) and the
arithmetic follows transformers' Qwen2VL video processor, which needs torchvision and so is
reimplemented here with numpy/torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

IMAGE_FACTOR = 28  # patch 14 x merge 2: resized sides must be multiples of it


@dataclass(frozen=True)
class VideoSampling:
    """How a video is turned into frames (qwen-omni-utils' defaults)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2  # = temporal_patch_size: frame counts are multiples of it
    min_pixels: int = 128 * 28 * 28  # per frame
    max_pixels: int = 768 * 28 * 28  # per frame
    total_pixels: int = int(128000 * 28 * 28 * 0.9)  # whole-video budget, shared by the frames
    image_factor: int = IMAGE_FACTOR
    num_frames: int = 0  # > 0: sample this many frames (rounded to frame_factor) instead of `fps`

    def updated(self, options: dict[str, Any] | None) -> "VideoSampling":
        """A copy with the fields named in `options` replaced (unknown names raise ValueError)."""
        if not options:
            return self
        known = set(self.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown video option(s) {unknown}; known: {sorted(known)}")
        try:
            values = {k: type(getattr(self, k))(v) for k, v in options.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad video option value in {options}: {e}") from None
        bad = sorted(k for k, v in values.items() if v <= 0)
        if bad:
            raise ValueError(f"video option(s) {bad} must be positive")
        return replace(self, **values)


def smart_resize(
    height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides multiples of `factor`, area within [min, max], aspect kept."""
    if min(height, width) <= 0:
        raise ValueError(f"empty image or frame ({height}x{width})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be below 200, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def num_sampled_frames(total_frames: int, video_fps: float, s: VideoSampling) -> int:
    """qwen-omni-utils' smart_nframes: `fps` frames per second within [min, max], a multiple
    of frame_factor, or `num_frames` when given. Differs in two cases: a video shorter than
    frame_factor frames gives frame_factor (its frames repeat), and num_frames beyond the
    video's frames gives all of them, instead of an error."""
    f = s.frame_factor
    if s.num_frames:  # qwen-omni-utils' `nframes` (vLLM's num_frames), within the video's frames
        return max(f, min(round(s.num_frames / f) * f, math.floor(total_frames / f) * f))
    min_frames = math.ceil(s.min_frames / f) * f
    max_frames = math.floor(min(s.max_frames, total_frames) / f) * f
    n = total_frames / video_fps * s.fps
    n = min(max(n, min_frames), max_frames, total_frames)
    return max(f, math.floor(n / f) * f)


def frame_indices(total_frames: int, n: int) -> np.ndarray:
    # Evenly spread over the whole video, first and last frame included (torch.linspace(...)
    # .round() in qwen-omni-utils; numpy and torch both round half to even).
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


def frame_size(height: int, width: int, num_frames: int, s: VideoSampling) -> tuple[int, int]:
    """Target (h, w) of every frame: per-frame bounds, capped by the frames' share of the
    whole-video budget but never below 1.05 x min_pixels (qwen-omni-utils' fetch_video)."""
    max_pixels = max(
        min(s.max_pixels, s.total_pixels / num_frames * s.frame_factor), int(s.min_pixels * 1.05)
    )
    return smart_resize(height, width, s.image_factor, s.min_pixels, int(max_pixels))


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T, height, width, 3] uint8, bicubic with antialiasing.

    The same kernel as torchvision's resize on a uint8 tensor (what qwen-omni-utils calls):
    computed in float, then rounded back to uint8.
    """
    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(
        x, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )
    x = x.round_().clamp_(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def patchify_video(
    frames: np.ndarray,
    image_mean: list[float],
    image_std: list[float],
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
) -> tuple[torch.Tensor, list[int]]:
    """[T, H, W, 3] uint8 frames (already resized) -> (pixel_values_videos, [grid_t, grid_h, grid_w]).

    transformers' Qwen2VL video processor math: rescale to [0, 1], normalize, pad the frame
    count to a multiple of temporal_patch_size by repeating the last frame, then flatten into
    [grid_t * grid_h * grid_w, 3 * temporal * patch * patch] rows ordered so that each
    merge_size x merge_size block of patches is contiguous (the vision merger relies on it).
    """
    t, h, w, c = frames.shape
    if h % (patch_size * merge_size) or w % (patch_size * merge_size):
        raise ValueError(f"frame size {h}x{w} is not a multiple of {patch_size * merge_size}")
    mean = torch.tensor(image_mean, dtype=torch.float32).view(1, c, 1, 1)
    std = torch.tensor(image_std, dtype=torch.float32).view(1, c, 1, 1)
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    x = (x / 255.0 - mean) / std
    if pad := -t % temporal_patch_size:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        t += pad
    grid_t, grid_h, grid_w = t // temporal_patch_size, h // patch_size, w // patch_size
    x = x.view(
        grid_t, temporal_patch_size, c,
        grid_h // merge_size, merge_size, patch_size,
        grid_w // merge_size, merge_size, patch_size,
    )
    # -> (t, h-block, w-block, h-in-block, w-in-block, channel, temporal, patch_h, patch_w)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    x = x.reshape(grid_t * grid_h * grid_w, c * temporal_patch_size * patch_size * patch_size)
    return x.contiguous(), [grid_t, grid_h, grid_w]
