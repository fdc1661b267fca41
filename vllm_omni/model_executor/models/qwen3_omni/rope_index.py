"""Qwen3-Omni M-RoPE position ids: its layout of the shared M-RoPE walk (models/mrope_index.py).

Unlike Qwen2.5-Omni's TMRoPE (qwen2_5_omni/positions.py), all HF's: every start marker gets its
own position (a video with its audio track opens with two markers at two consecutive positions);
the audio token count follows the chunked audio encoder (`audio_output_length`); a video's frames
and its audio track are merged token by token by their t value (a video token first on ties);
and positions are float32 (t = frame index * seconds per grid * position_id_per_seconds is not
truncated), so a video sampled at an odd frame rate gets fractional positions: every 29.97 fps
video, every 1 s clip (4 frames sampled: 0.5 s per grid, t = 6.5 per frame group).
`as_index_positions` turns the usual all-integral result into a long tensor so the rotary can use
its exact cos/sin tables, and `GeneratedPositions` continues a prompt's positions through
generation as HF's generate does.

Shared by the thinker and the talker (both read their own config, see `RopeTokenConfig`).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.model_executor.models.mrope_index import MRopeLayout, VideoAudio, mrope_index

# What the released audio encoder emits per full 100-frame window (n_window=50); HF hard-codes it.
_TOKENS_PER_FULL_WINDOW = 13


def audio_output_length(num_frames: int, n_window: int = 50) -> int:
    """Audio tokens for `num_frames` mel frames (HF `_get_feat_extract_output_lengths`): full
    windows of 2 * n_window frames give 13 tokens each, the remainder goes through three stride-2 convs."""
    window = 2 * n_window
    rest = (num_frames % window - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // window) * _TOKENS_PER_FULL_WINDOW


@dataclass(frozen=True)
class RopeTokenConfig(MRopeLayout):
    @classmethod
    def from_config(cls, config: Any, audio_n_window: int | None = None) -> RopeTokenConfig:
        """From a Qwen3-Omni thinker config (or a talker config, which states its own merge size
        but has no audio config: pass the thinker's `audio_config.n_window` then)."""
        merge = getattr(config, "spatial_merge_size", None) or config.vision_config.spatial_merge_size
        if audio_n_window is None:
            audio_n_window = config.audio_config.n_window
        return cls(
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            audio_token_id=config.audio_token_id,
            vision_start_token_id=config.vision_start_token_id,
            audio_start_token_id=config.audio_start_token_id,
            spatial_merge_size=merge,
            position_id_per_seconds=config.position_id_per_seconds,
            audio_tokens=functools.partial(audio_output_length, n_window=audio_n_window),
            integer_time=False,
            video_audio=VideoAudio.BY_TIME,
        )


def qwen3_omni_rope_index(input_ids: Sequence[int], cfg: RopeTokenConfig, **media: Any) -> tuple[torch.Tensor, float]:
    """(positions [3, len(input_ids)] float32, HF rope delta = max + 1 - len) for one prompt;
    `media`: mrope_index's grids, audio lengths, seconds per grid and use_audio_in_video."""
    return mrope_index(input_ids, cfg, **media)


class GeneratedPositions:
    """Positions of generated tokens: each row continues from the prompt's last column by +1 per
    step, in the positions' dtype, the way transformers' generate extends `position_ids`
    (`position_ids[..., -1:] + 1` after every step). For float32 positions that is a running
    sum rounded at every step, which can differ in the last bit from `last + k`; the columns are
    therefore built one step at a time and kept (one instance per request, in its model state)."""

    def __init__(self, last_column: torch.Tensor) -> None:
        self.last = last_column  # [3, 1] long or float32, CPU
        self._columns: list[torch.Tensor] = []
        self._last_values: tuple[int, ...] | None = None if last_column.is_floating_point() \
            else tuple(last_column[:, 0].tolist())

    def at(self, index: int) -> tuple[int, ...] | tuple[float, ...]:
        """The (t, h, w) positions of generated token `index` as Python numbers (a decode step)."""
        if self._last_values is not None:
            return tuple(v + index + 1 for v in self._last_values)
        return tuple(self.span(index, index + 1)[:, 0].tolist())

    def span(self, first: int, end: int) -> torch.Tensor:
        """[3, end - first] positions of generated tokens first..end-1 (0: the first one)."""
        if not self.last.is_floating_point():  # integers: the sum is exact
            return self.last + torch.arange(first + 1, end + 1)
        while len(self._columns) < end:
            self._columns.append((self._columns[-1] if self._columns else self.last) + 1)
        return torch.cat(self._columns[first:end], dim=1)


def as_index_positions(positions: torch.Tensor) -> torch.Tensor:
    """Long positions when every value is integral (the usual case: exact table lookups in the
    rotary), else the float32 positions themselves (the rotary computes those angles directly)."""
    as_long = positions.long()
    return as_long if torch.equal(as_long.float(), positions) else positions
