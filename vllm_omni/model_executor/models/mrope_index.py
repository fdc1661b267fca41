"""The multimodal RoPE position walk of the Omni thinkers and talkers (our port of transformers'
`get_rope_index` of Qwen2.5-Omni, TMRoPE, and of Qwen3-Omni): one walk, each family's layout
in its `MRopeLayout` (qwen2_5_omni/positions.py, qwen3_omni/rope_index.py).

Text tokens advance all three rows (t, h, w) together. An image or video gets a 3D grid:
t = frame index * seconds per grid * `position_id_per_seconds`, h/w = merged patch row and
column, all offset by the next free position; audio advances like text. Blocks are found by
their start markers (`<|vision_start|>` / `<|audio_start|>`); each block starts at HF's
`llm_pos_ids_list[-1].max() + 1`, the max of the last piece appended. The two families differ,
all as in HF:
- the audio tokens of n mel frames (`audio_tokens`);
- Qwen2.5 truncates a frame's t to an integer, Qwen3 keeps it in float32 (a 29.97 fps video
  gets fractional positions) (`integer_time`);
- a video with its audio track (`use_audio_in_video`): Qwen2.5 gives its two start markers one
  shared position and interleaves frames and audio in chunks of `seconds_per_chunk`; Qwen3 gives
  each marker its own position and merges them token by token by t, a frame first on ties
  (`video_audio`).
Positions are computed in float32, HF's order of operations; integral values are exact there.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class VideoAudio(enum.Enum):
    CHUNKS = "chunks"  # Qwen2.5
    BY_TIME = "by_time"  # Qwen3


@dataclass(frozen=True)
class MRopeLayout:
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: int | float
    audio_tokens: Callable[[int], int]  # audio tokens of n mel frames
    integer_time: bool
    video_audio: VideoAudio
    seconds_per_chunk: int | float = 0  # CHUNKS: the interleave's chunk length


def _text(length: int, start: float) -> torch.Tensor:
    return torch.arange(length, dtype=torch.float32).view(1, -1).expand(3, -1) + start


def vision_positions(start: float, grid_thw: Sequence[int], merge: int, t_index: torch.Tensor) -> torch.Tensor:
    """[3, t*h*w/merge^2] float32 positions of one image/video: frame-major, then row, then column."""
    grid_h, grid_w = int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    frames = len(t_index)
    t = t_index.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h).view(1, -1, 1).expand(frames, -1, grid_w).flatten().float()
    w = torch.arange(grid_w).view(1, 1, -1).expand(frames, grid_h, -1).flatten().float()
    return torch.stack([t, h, w]) + start


def chunk_spans(values: list[float], tokens_per_chunk: int, offset: float) -> list[tuple[int, int]]:
    """HF's `get_chunked_index`: split at each point where `value - offset` reaches the next
    multiple of `tokens_per_chunk` (one boundary per token at most, as HF's loop does)."""
    spans, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value - offset >= chunk * tokens_per_chunk:
            spans.append((start, i))
            start, chunk = i, chunk + 1
    spans.append((start, len(values)))
    return spans


def merge_by_time(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class _Blocks:
    """Position blocks laid down so far. `next` is HF's `llm_pos_ids_list[-1].max() + 1`: the
    max of the last piece appended (after a time-merged video + audio, its final piece)."""

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

    def text(self, length: int) -> None:
        self.add(_text(length, self.next))


@dataclass(frozen=True)
class _Inputs:
    layout: MRopeLayout
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    audio_seqlens: torch.Tensor | None
    second_per_grids: torch.Tensor | None

    def audio_len(self, idx: int) -> int:
        if self.audio_seqlens is None:
            raise ValueError("the prompt has audio placeholders but no audio feature lengths were given")
        return self.layout.audio_tokens(int(self.audio_seqlens[idx]))

    def _time(self, t: torch.Tensor) -> torch.Tensor:
        return t.long().float() if self.layout.integer_time else t.float()

    def image_t(self, idx: int) -> torch.Tensor:
        return self._time(torch.arange(int(self.image_grid_thw[idx][0])) * 1 * self.layout.position_id_per_seconds)

    def video_t(self, idx: int) -> torch.Tensor:
        if self.second_per_grids is None:
            raise ValueError("the prompt has a video but no video_second_per_grid was given")
        spg = torch.as_tensor(self.second_per_grids[idx]).cpu().float()  # float32, HF's order
        return self._time(torch.arange(int(self.video_grid_thw[idx][0])) * spg * self.layout.position_id_per_seconds)

    def vision_len(self, grid: torch.Tensor) -> int:
        return int(grid.prod()) // self.layout.spatial_merge_size**2


def _video_with_audio(blocks: _Blocks, inputs: _Inputs, video_idx: int, audio_idx: int) -> int:
    """`<|vision_start|><|audio_start|>` frames and audio `<|audio_end|><|vision_end|>`; -> its
    placeholder tokens."""
    layout = inputs.layout
    shared_markers = layout.video_audio is VideoAudio.CHUNKS
    first = blocks.next
    blocks.add(_text(1, first) if shared_markers else _text(2, first))
    if shared_markers:
        blocks.add(_text(1, first))
    start = blocks.next
    grid = inputs.video_grid_thw[video_idx]
    length = inputs.audio_len(audio_idx)
    video = vision_positions(start, grid, layout.spatial_merge_size, inputs.video_t(video_idx))
    audio = _text(length, start)
    if layout.video_audio is VideoAudio.BY_TIME:
        blocks.add(*merge_by_time(video, audio))
    else:
        per_chunk = int(layout.position_id_per_seconds * layout.seconds_per_chunk)
        video_spans = chunk_spans(video[0].tolist(), per_chunk, start)
        audio_spans = chunk_spans(audio[0].tolist(), per_chunk, start)
        for j in range(max(len(video_spans), len(audio_spans))):
            if j < len(video_spans):
                blocks.add(video[:, video_spans[j][0]: video_spans[j][1]])
            if j < len(audio_spans):
                blocks.add(audio[:, audio_spans[j][0]: audio_spans[j][1]])
    last = blocks.next
    blocks.add(_text(1, last) if shared_markers else _text(2, last))
    if shared_markers:
        blocks.add(_text(1, last))
    return length + inputs.vision_len(grid)


def mrope_index(
    input_ids: Sequence[int],
    layout: MRopeLayout,
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
    inputs = _Inputs(layout, None if image_grid_thw is None else torch.as_tensor(image_grid_thw).cpu(),
                     None if video_grid_thw is None else torch.as_tensor(video_grid_thw).cpu(),
                     audio_seqlens, second_per_grids)
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    tokens = ids.tolist()
    after_vision_start = ids[torch.argwhere(ids[:-1] == layout.vision_start_token_id).squeeze(1) + 1]
    remain_audios = int((ids == layout.audio_start_token_id).sum())
    remain_images = int((after_vision_start == layout.image_token_id).sum())
    video_marker = layout.audio_start_token_id if use_audio_in_video else layout.video_token_id
    remain_videos = int((after_vision_start == video_marker).sum())
    num_blocks = remain_images + remain_audios + (0 if use_audio_in_video else remain_videos)
    has_vision = layout.image_token_id in tokens or layout.video_token_id in tokens
    blocks = _Blocks()
    st = image_idx = video_idx = audio_idx = 0

    def find(marker: int, what: str) -> int:
        try:
            return tokens.index(marker, st)
        except ValueError:
            raise ValueError(f"the prompt has fewer {what} start markers than its {what} inputs") from None

    for _ in range(num_blocks):
        vision_at = find(layout.vision_start_token_id, "vision") if has_vision and (remain_videos or remain_images) \
            else num_tokens + 1
        audio_at = find(layout.audio_start_token_id, "audio") if layout.audio_token_id in tokens and remain_audios \
            else num_tokens + 1
        first = min(vision_at, audio_at)
        if first >= num_tokens - 1:
            raise ValueError("the prompt's multimodal start markers do not match its multimodal inputs")
        text_len = first - st
        blocks.text(text_len)
        if first == vision_at and vision_at + 1 == audio_at:  # a video with its audio track
            length = _video_with_audio(blocks, inputs, video_idx, audio_idx)
            audio_idx, video_idx = audio_idx + 1, video_idx + 1
            remain_audios, remain_videos = remain_audios - 1, remain_videos - 1
            st += text_len + 4 + length
            continue
        blocks.text(1)  # <|audio_start|> / <|vision_start|>
        start = blocks.next
        if first == audio_at:
            length = inputs.audio_len(audio_idx)
            blocks.add(_text(length, start))
            audio_idx, remain_audios = audio_idx + 1, remain_audios - 1
        elif tokens[first + 1] == layout.image_token_id:
            grid = inputs.image_grid_thw[image_idx]
            blocks.add(vision_positions(start, grid, layout.spatial_merge_size, inputs.image_t(image_idx)))
            length = inputs.vision_len(grid)
            image_idx, remain_images = image_idx + 1, remain_images - 1
        elif tokens[first + 1] == layout.video_token_id:
            grid = inputs.video_grid_thw[video_idx]
            blocks.add(vision_positions(start, grid, layout.spatial_merge_size, inputs.video_t(video_idx)))
            length = inputs.vision_len(grid)
            video_idx, remain_videos = video_idx + 1, remain_videos - 1
        else:
            raise ValueError(f"token {tokens[first + 1]} after <|vision_start|> at {first} is not an image, "
                             "video or audio placeholder")
        blocks.text(1)  # the matching end marker
        st += text_len + 2 + length

    if st < num_tokens:
        blocks.text(num_tokens - st)
    positions = torch.cat(blocks.blocks, dim=1)
    if positions.shape[1] != num_tokens:
        raise ValueError(
            f"the prompt has {num_tokens} tokens but its multimodal layout (grids, audio lengths) accounts for "
            f"{positions.shape[1]}: placeholder counts do not match the multimodal inputs"
        )
    return positions, float(positions.max()) + 1 - num_tokens
