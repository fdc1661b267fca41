"""TMRoPE position ids of Qwen2.5-Omni: its layout of the shared M-RoPE walk (models/mrope_index.py).

A frame's t is truncated to an integer; audio advances one position per audio token (40 ms at
25 positions/s); with `use_audio_in_video` a video's two start markers share one position and its
frames and audio track are cut into `seconds_per_chunk` chunks by their t value and interleaved
chunk by chunk. The returned delta is HF's `rope_deltas` (max + 1 - prompt length), which HF's
talker uses to continue positions while decoding; HF's thinker generate instead continues from
the last prompt position + 1 (the same unless a prompt's largest position is not its last).

Shared by the thinker and the talker (both take their token ids and timing from their own
config, see `MRopeTokenConfig.from_config`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.model_executor.models.mrope_index import MRopeLayout, VideoAudio, mrope_index


def audio_output_length(num_frames: int) -> int:
    """Audio tokens for `num_frames` mel frames (conv stride 2, then average pooling stride 2)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True)
class MRopeTokenConfig(MRopeLayout):
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
            audio_tokens=audio_output_length,
            integer_time=True,
            video_audio=VideoAudio.CHUNKS,
            seconds_per_chunk=config.seconds_per_chunk,
        )


def omni_rope_index(input_ids: Sequence[int], cfg: MRopeTokenConfig, **media: Any) -> tuple[torch.Tensor, int]:
    """(positions [3, len(input_ids)] long, HF rope delta = max + 1 - len) for one prompt; `media`:
    mrope_index's grids, audio lengths, seconds per grid and use_audio_in_video."""
    positions, delta = mrope_index(input_ids, cfg, **media)
    return positions.long(), int(delta)
