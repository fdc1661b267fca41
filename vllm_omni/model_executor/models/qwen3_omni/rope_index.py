"""Qwen3-Omni M-RoPE position ids: our port of transformers' Qwen3-Omni `get_rope_index`.

Differs from Qwen2.5-Omni's TMRoPE (qwen2_5_omni/positions.py) in four ways, all HF's:
- blocks are found by their *start markers* (`<|vision_start|>`, `<|audio_start|>`), and
  every marker gets its own position (a video with its audio track opens with two markers at
  two consecutive positions, not one shared position);
- the audio token count follows the chunked audio encoder (`audio_output_length`);
- a video's frames and its audio track are merged token by token by their t value (a video
  token first on ties), not in fixed-size chunks;
- positions are float32 (t = frame index * seconds per grid * position_id_per_seconds is
  not truncated), so a video sampled at an odd frame rate gets fractional positions: every
  29.97 fps video, every 1 s clip (4 frames sampled: 0.5 s per grid, t = 6.5 per frame group).
The arithmetic follows HF's float32 order exactly; `as_index_positions` turns the usual
all-integral result into a long tensor so the rotary can use its exact cos/sin tables, and
`GeneratedPositions` continues a prompt's positions through generation as HF's generate does.

Shared by the thinker and the talker (both read their own config, see `RopeTokenConfig`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# What the released audio encoder emits per full 100-frame window (n_window=50); HF hard-codes it.
_TOKENS_PER_FULL_WINDOW = 13


@dataclass(frozen=True)
class RopeTokenConfig:
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: int | float
    audio_n_window: int

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
            audio_n_window=audio_n_window,
        )


def audio_output_length(num_frames: int, n_window: int = 50) -> int:
    """Audio tokens for `num_frames` mel frames (HF `_get_feat_extract_output_lengths`): full
    windows of 2 * n_window frames give 13 tokens each, the remainder goes through three stride-2 convs."""
    window = 2 * n_window
    rest = (num_frames % window - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // window) * _TOKENS_PER_FULL_WINDOW


def _vision_positions(start: float, grid_thw: Sequence[int], merge: int, t_index: torch.Tensor) -> torch.Tensor:
    """[3, t*h*w/merge^2] float32 positions of one image/video: frame-major, then row, then column."""
    grid_h, grid_w = int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    frames = len(t_index)
    t = t_index.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h).view(1, -1, 1).expand(frames, -1, grid_w).flatten().float()
    w = torch.arange(grid_w).view(1, 1, -1).expand(frames, grid_h, -1).flatten().float()
    return torch.stack([t, h, w]) + start


def _text(length: int, start: float) -> torch.Tensor:
    return torch.arange(length, dtype=torch.float32).view(1, -1).expand(3, -1) + start


class _Blocks:
    """Position blocks laid down so far. `next` is HF's `llm_pos_ids_list[-1].max() + 1`: the
    max of the *last block appended*, which after a merged video+audio is its final piece."""

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []
        self._last_max = -1.0

    @property
    def next(self) -> float:
        return self._last_max + 1

    def add(self, block: torch.Tensor, last_piece: torch.Tensor | None = None) -> None:
        if block.shape[1]:  # HF never appends an empty block (or fails on its max())
            self.blocks.append(block)
            self._last_max = float((block if last_piece is None else last_piece).max())


def _merge_by_time(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's token-by-token merge of a video's positions with its audio track's by t (video
    first on ties), then the rest of whichever is left. Returns (merged, HF's last piece)."""
    v_t, a_t = video[0].tolist(), audio[0].tolist()
    vi = ai = 0
    order: list[int] = []
    while vi < len(v_t) and ai < len(a_t):
        if v_t[vi] <= a_t[ai]:
            order.append(vi)
            vi += 1
        else:
            order.append(len(v_t) + ai)
            ai += 1
    tail = list(range(vi, len(v_t))) or list(range(len(v_t) + ai, len(v_t) + len(a_t)))
    merged = torch.cat([video, audio], dim=1)[:, order + tail]
    return merged, merged[:, -len(tail):] if tail else merged[:, -1:]


def qwen3_omni_rope_index(
    input_ids: Sequence[int],
    cfg: RopeTokenConfig,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    audio_seqlens: torch.Tensor | None = None,
    second_per_grids: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, float]:
    """(positions [3, len(input_ids)] float32, HF rope delta = max + 1 - len) for one prompt."""
    num_tokens = len(input_ids)
    if image_grid_thw is None and video_grid_thw is None:
        # HF's branch without vision: plain positions (audio alone is laid out contiguously anyway).
        return _text(num_tokens, 0.0).clone(), 0.0
    image_grid_thw = None if image_grid_thw is None else torch.as_tensor(image_grid_thw).cpu()
    video_grid_thw = None if video_grid_thw is None else torch.as_tensor(video_grid_thw).cpu()
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    tokens = ids.tolist()
    starts = torch.argwhere(ids[:-1] == cfg.vision_start_token_id).squeeze(1)
    after_vision_start = ids[starts + 1]
    remain_audios = int((ids == cfg.audio_start_token_id).sum())
    remain_images = int((after_vision_start == cfg.image_token_id).sum())
    video_marker = cfg.audio_start_token_id if use_audio_in_video else cfg.video_token_id
    remain_videos = int((after_vision_start == video_marker).sum())
    num_blocks = remain_images + remain_audios + (0 if use_audio_in_video else remain_videos)
    merge, pps = cfg.spatial_merge_size, cfg.position_id_per_seconds
    has_vision = cfg.image_token_id in tokens or cfg.video_token_id in tokens
    blocks = _Blocks()
    st = image_idx = video_idx = audio_idx = 0

    def find(marker: int, what: str) -> int:
        try:
            return tokens.index(marker, st)
        except ValueError:
            raise ValueError(f"the prompt has fewer {what} start markers than its {what} inputs") from None

    def audio_len() -> int:
        if audio_seqlens is None:
            raise ValueError("the prompt has audio placeholders but no audio feature lengths were given")
        return audio_output_length(int(audio_seqlens[audio_idx]), cfg.audio_n_window)

    def video_t_index() -> torch.Tensor:
        if second_per_grids is None:
            raise ValueError("the prompt has a video but no video_second_per_grid was given")
        spg = torch.as_tensor(second_per_grids[video_idx]).cpu().float()
        return torch.arange(int(video_grid_thw[video_idx][0])) * spg * pps  # float32, HF's order

    def vision_len(grid: torch.Tensor) -> int:
        return int(grid.prod()) // merge**2

    for _ in range(num_blocks):
        vision_at = find(cfg.vision_start_token_id, "vision") if has_vision and (remain_videos or remain_images) \
            else num_tokens + 1
        audio_at = find(cfg.audio_start_token_id, "audio") if cfg.audio_token_id in tokens and remain_audios \
            else num_tokens + 1
        first = min(vision_at, audio_at)
        if first >= num_tokens - 1:
            raise ValueError("the prompt's multimodal start markers do not match its multimodal inputs")
        text_len = first - st
        blocks.add(_text(text_len, blocks.next))
        audio_in_video = first == vision_at and vision_at + 1 == audio_at
        marker_len = 2 if audio_in_video else 1
        blocks.add(_text(marker_len, blocks.next))  # <|audio_start|> / <|vision_start|> (+ <|audio_start|>)
        start = blocks.next
        if first == audio_at:
            length = audio_len()
            blocks.add(_text(length, start))
            audio_idx, remain_audios = audio_idx + 1, remain_audios - 1
        elif tokens[first + 1] == cfg.image_token_id:
            grid = image_grid_thw[image_idx]
            t_index = torch.arange(int(grid[0])) * 1 * float(pps)
            blocks.add(_vision_positions(start, grid, merge, t_index.float()))
            length = vision_len(grid)
            image_idx, remain_images = image_idx + 1, remain_images - 1
        elif tokens[first + 1] == cfg.video_token_id:
            grid = video_grid_thw[video_idx]
            blocks.add(_vision_positions(start, grid, merge, video_t_index()))
            length = vision_len(grid)
            video_idx, remain_videos = video_idx + 1, remain_videos - 1
        elif audio_in_video:
            grid = video_grid_thw[video_idx]
            audio_n = audio_len()
            video_pos = _vision_positions(start, grid, merge, video_t_index())
            merged, last_piece = _merge_by_time(video_pos, _text(audio_n, start))
            blocks.add(merged, last_piece)
            length = audio_n + vision_len(grid)
            audio_idx, video_idx = audio_idx + 1, video_idx + 1
            remain_audios, remain_videos = remain_audios - 1, remain_videos - 1
        else:
            raise ValueError(f"token {tokens[first + 1]} after <|vision_start|> at {first} is not an image, "
                             "video or audio placeholder")
        blocks.add(_text(marker_len, blocks.next))  # the matching end marker(s)
        st += text_len + 2 * marker_len + length

    if st < num_tokens:
        blocks.add(_text(num_tokens - st, blocks.next))
    positions = torch.cat(blocks.blocks, dim=1)
    if positions.shape[1] != num_tokens:
        raise ValueError(
            f"the prompt has {num_tokens} tokens but its multimodal layout (grids, audio lengths) accounts for "
            f"{positions.shape[1]}: placeholder counts do not match the multimodal inputs"
        )
    return positions, float(positions.max()) + 1 - num_tokens


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
