"""The thinker -> talker payload both Omni families' bridges send (Qwen3-Omni's adds a field).

The talker's input follows transformers' generate: the thinker's input embeddings (hidden-state
key "0") and hidden states of the prompt and of every reply token that has them (all but the
last sampled token), the voice and the prompt's multimodal layout. The payload is a typed
dataclass flattened into `additional_information` (tensors and msgpack data only, so it travels
as frames); the talker parses it back with `from_info`, which validates shapes.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.model_executor.models.bridge_utils import (
    LAYOUT_TENSOR_KEYS,
    SPEAKER_KEY,
    USE_AUDIO_IN_VIDEO_KEY,
    check_speaker,
)

THINKER_EMBEDS_KEY = "0"  # transformers' output_hidden_states index 0: the input embeddings
THINKER_HIDDEN_KEY = "last"  # final post-norm hidden states
_REQUIRED_KEYS = ("thinker_prompt_token_ids", "thinker_embeds", "thinker_hidden")


@dataclass(frozen=True)
class TalkerInputs:
    """thinker2talker payload for one request (P prompt tokens, R = reply tokens - 1)."""

    thinker_prompt_token_ids: list[int]  # [P]; the talker zeroes multimodal placeholder rows
    thinker_embeds: torch.Tensor  # [P + R, E] thinker input embeddings
    thinker_hidden: torch.Tensor  # [P + R, E] thinker final hidden states
    speaker: str | None = None  # None: the talker's default voice
    # Multimodal layout of the thinker prompt (None when it has no such media).
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]
    video_grid_thw: torch.Tensor | None = None  # [num_videos, 3]
    video_second_per_grid: torch.Tensor | None = None  # [num_videos]
    audio_feature_lengths: torch.Tensor | None = None  # [num_audios] valid mel frames
    use_audio_in_video: bool = False

    def __post_init__(self) -> None:
        num_prompt = len(self.thinker_prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("talker inputs: the thinker prompt is empty")
        for name in ("thinker_embeds", "thinker_hidden"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"talker inputs: {name} must be a [tokens, hidden] tensor, got {_describe(t)}")
            if t.shape[0] < num_prompt:
                raise ValueError(f"talker inputs: {name} has {t.shape[0]} rows, fewer than the "
                                 f"{num_prompt} prompt tokens")
        if self.thinker_embeds.shape != self.thinker_hidden.shape:
            raise ValueError(f"talker inputs: thinker_embeds {tuple(self.thinker_embeds.shape)} and "
                             f"thinker_hidden {tuple(self.thinker_hidden.shape)} differ in shape")
        for name in LAYOUT_TENSOR_KEYS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"talker inputs: {name} must be a tensor, got {type(value).__name__}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.thinker_prompt_token_ids)

    def to_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "thinker_prompt_token_ids": list(self.thinker_prompt_token_ids),
            "thinker_embeds": self.thinker_embeds,
            "thinker_hidden": self.thinker_hidden,
        }
        for name in LAYOUT_TENSOR_KEYS:
            if getattr(self, name) is not None:
                info[name] = getattr(self, name)
        if self.use_audio_in_video:
            info[USE_AUDIO_IN_VIDEO_KEY] = True
        if self.speaker is not None:
            info[SPEAKER_KEY] = self.speaker
        return info

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TalkerInputs:
        known = {*_REQUIRED_KEYS, *LAYOUT_TENSOR_KEYS, USE_AUDIO_IN_VIDEO_KEY, SPEAKER_KEY}
        unknown = sorted(set(info) - known)
        if unknown:
            raise ValueError(f"talker inputs: unknown key(s) {unknown}; expected {sorted(known)}")
        missing = sorted(set(_REQUIRED_KEYS) - set(info))
        if missing:
            raise ValueError(f"talker inputs: missing {missing} (the talker needs the thinker2talker bridge's output)")
        return cls(
            thinker_prompt_token_ids=[int(t) for t in info["thinker_prompt_token_ids"]],
            thinker_embeds=info["thinker_embeds"],
            thinker_hidden=info["thinker_hidden"],
            speaker=check_speaker(info.get(SPEAKER_KEY)),
            use_audio_in_video=bool(info.get(USE_AUDIO_IN_VIDEO_KEY, False)),
            **{name: info.get(name) for name in LAYOUT_TENSOR_KEYS},
        )


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
