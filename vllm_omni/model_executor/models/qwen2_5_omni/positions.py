"""TMRoPE position ids of Qwen2.5-Omni (our port of transformers' `get_rope_index`).

Text tokens advance all three rows (t, h, w) together. A vision item gets a 3D grid:
t = frame index * seconds per grid * `position_id_per_seconds`, h/w = merged patch row and
column, all offset by the next free position. Audio advances like text (one position per
audio token = 40 ms at 25 positions/s). With `use_audio_in_video`, a video's frames and its
audio track are cut into `seconds_per_chunk` chunks by their t value and interleaved chunk
by chunk. The next block always starts at (max of the *previous block*) + 1, exactly as HF
does. The returned delta is HF's `rope_deltas` (max + 1 - prompt length), which HF's talker
uses to continue positions while decoding; HF's thinker generate instead continues from the
last prompt position + 1 (the same unless a prompt's largest position is not its last).

Shared by the thinker and the talker (both take their token ids and timing from their own
config, see `MRopeTokenConfig.from_config`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MRopeTokenConfig:
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: int | float
    seconds_per_chunk: int | float

    @classmethod
    def from_config(cls, config: Any) -> MRopeTokenConfig:
        """From a Qwen2.5-Omni thinker or talker config (the talker states its own merge size)."""
        merge = getattr(config, "spatial_merge_size", None)
        if merge is None:
            merge = config.vision_config.spatial_merge_size
        return cls(
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            audio_token_id=config.audio_token_id,
            vision_start_token_id=config.vision_start_token_id,
            audio_start_token_id=config.audio_start_token_id,
            spatial_merge_size=merge,
            position_id_per_seconds=config.position_id_per_seconds,
            seconds_per_chunk=config.seconds_per_chunk,
        )


def audio_output_length(num_frames: int) -> int:
    """Audio tokens for `num_frames` mel frames (conv stride 2, then average pooling stride 2)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def vision_grid_positions(start: int, grid_thw: Sequence[int], merge: int, t_index: torch.Tensor) -> torch.Tensor:
    """[3, t*h*w/merge^2] positions of one image/video: frame-major, then row, then column."""
    grid_h, grid_w = int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    frames = len(t_index)
    t = t_index.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h).view(1, -1, 1).expand(frames, -1, grid_w).flatten()
    w = torch.arange(grid_w).view(1, 1, -1).expand(frames, grid_h, -1).flatten()
    return torch.stack([t, h, w]) + start


def chunk_spans(values: list[int], tokens_per_chunk: int, offset: int) -> list[tuple[int, int]]:
    """HF's `get_chunked_index`: split at each point where `value - offset` reaches the next
    multiple of `tokens_per_chunk` (one boundary per token at most, as HF's loop does)."""
    spans, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value - offset >= chunk * tokens_per_chunk:
            spans.append((start, i))
            start, chunk = i, chunk + 1
    spans.append((start, len(values)))
    return spans


class _Blocks:
    """The position blocks laid down so far; `next` is HF's `llm_pos_ids_list[-1].max() + 1`."""

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []

    @property
    def next(self) -> int:
        return int(self.blocks[-1].max()) + 1 if self.blocks else 0

    def add(self, block: torch.Tensor) -> None:
        if block.shape[1]:  # HF would fail on an empty block's max(); skipping it changes nothing else
            self.blocks.append(block)

    def text(self, length: int, start: int | None = None) -> None:
        start = self.next if start is None else start
        self.add(torch.arange(length).view(1, -1).expand(3, -1) + start)


def omni_rope_index(
    input_ids: Sequence[int],
    cfg: MRopeTokenConfig,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    audio_seqlens: torch.Tensor | None = None,
    second_per_grids: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, int]:
    """(positions [3, len(input_ids)] long, HF rope delta = max + 1 - len) for one prompt."""
    num_tokens = len(input_ids)
    if image_grid_thw is None and video_grid_thw is None:
        # HF's branch without vision: plain positions (audio alone is laid out contiguously anyway).
        return torch.arange(num_tokens).view(1, -1).expand(3, -1).clone(), 0
    image_grid_thw = None if image_grid_thw is None else torch.as_tensor(image_grid_thw).cpu()
    video_grid_thw = None if video_grid_thw is None else torch.as_tensor(video_grid_thw).cpu()
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    tokens = ids.tolist()
    starts = torch.argwhere(ids[:-1] == cfg.vision_start_token_id).squeeze(1)
    after_vision_start = ids[starts + 1]
    num_audios = int((ids == cfg.audio_start_token_id).sum())
    num_images = int((after_vision_start == cfg.image_token_id).sum())
    video_marker = cfg.audio_start_token_id if use_audio_in_video else cfg.video_token_id
    num_videos = int((after_vision_start == video_marker).sum())
    remaining = {"image": num_images, "video": num_videos, "audio": num_audios}
    kind_token = {"image": cfg.image_token_id, "video": cfg.video_token_id, "audio": cfg.audio_token_id}
    merge, pps = cfg.spatial_merge_size, cfg.position_id_per_seconds
    blocks = _Blocks()
    st = image_idx = video_idx = audio_idx = 0

    def audio_len(idx: int) -> int:
        if audio_seqlens is None:
            raise ValueError("the prompt has audio placeholders but no audio feature lengths were given")
        return audio_output_length(int(audio_seqlens[idx]))

    def video_t_index(idx: int) -> torch.Tensor:
        if second_per_grids is None:
            raise ValueError("the prompt has a video but no video_second_per_grid was given")
        # float32 arithmetic in HF's order, then truncation: the same integer positions.
        spg = torch.as_tensor(second_per_grids[idx]).cpu().float()
        return (torch.arange(int(video_grid_thw[idx][0])) * spg * pps).long()

    for _ in range(num_images + num_audios if use_audio_in_video else num_images + num_videos + num_audios):
        found = {
            kind: tokens.index(kind_token[kind], st) if remaining[kind] > 0 and kind_token[kind] in tokens
            else num_tokens + 1
            for kind in ("image", "video", "audio")
        }
        first = min(found.values())
        if first == found["audio"]:
            text_len = first - st - 1
            if text_len:
                blocks.text(text_len)
            blocks.text(1)  # <|audio_bos|>
            length = audio_len(audio_idx)
            blocks.text(length)
            blocks.text(1)  # <|audio_eos|>
            st += text_len + 2 + length
            audio_idx += 1
            remaining["audio"] -= 1
        elif first == found["image"] or not use_audio_in_video:
            kind = "image" if first == found["image"] else "video"
            idx = image_idx if kind == "image" else video_idx
            grid = (image_grid_thw if kind == "image" else video_grid_thw)[idx]
            text_len = first - st - 1
            if text_len:
                blocks.text(text_len)
            blocks.text(1)  # <|vision_bos|>
            t_index = (torch.arange(int(grid[0])) * 1 * pps).long() if kind == "image" else video_t_index(idx)
            blocks.add(vision_grid_positions(blocks.next, grid, merge, t_index))
            blocks.text(1)  # <|vision_eos|>
            st += text_len + 2 + int(grid.prod()) // merge**2
            if kind == "image":
                image_idx += 1
            else:
                video_idx += 1
            remaining[kind] -= 1
        else:  # a video with its audio track: <|vision_bos|><|audio_bos|> chunks <|audio_eos|><|vision_eos|>
            text_len = first - st - 2
            if text_len:
                blocks.text(text_len)
            bos = blocks.next
            blocks.text(1, bos)
            blocks.text(1, bos)  # both start markers share one position
            start = blocks.next
            length = audio_len(audio_idx)
            audio_pos = torch.arange(length).view(1, -1).expand(3, -1) + start
            grid = video_grid_thw[video_idx]
            video_pos = vision_grid_positions(start, grid, merge, video_t_index(video_idx))
            per_chunk = int(pps * cfg.seconds_per_chunk)
            video_spans = chunk_spans(video_pos[0].tolist(), per_chunk, start)
            audio_spans = chunk_spans(audio_pos[0].tolist(), per_chunk, start)
            for j in range(max(len(video_spans), len(audio_spans))):
                if j < len(video_spans):
                    blocks.add(video_pos[:, video_spans[j][0] : video_spans[j][1]])
                if j < len(audio_spans):
                    blocks.add(audio_pos[:, audio_spans[j][0] : audio_spans[j][1]])
            eos = blocks.next
            blocks.text(1, eos)
            blocks.text(1, eos)
            st += text_len + 4 + length + int(grid.prod()) // merge**2
            audio_idx += 1
            video_idx += 1
            remaining["video"] -= 1
            remaining["audio"] -= 1

    if st < num_tokens:
        blocks.text(num_tokens - st)
    positions = torch.cat(blocks.blocks, dim=1)
    if positions.shape[1] != num_tokens:
        raise ValueError(
            f"the prompt has {num_tokens} tokens but its multimodal layout (grids, audio lengths) accounts for "
            f"{positions.shape[1]}: placeholder counts do not match the multimodal inputs"
        )
    return positions, int(positions.max()) + 1 - num_tokens
