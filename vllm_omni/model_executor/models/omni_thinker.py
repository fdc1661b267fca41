"""What the Qwen2.5-Omni and Qwen3-Omni thinkers share: their checkpoint layout and the media
inputs they read from `request.model_inputs`."""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.model_executor.models.decoder import DecoderForCausalLM
from vllm_omni.model_executor.models.qwen2_5_omni.towers import audio_feature_lengths

# Checkpoint name (after the stage prefix) -> our module prefix. Saved checkpoints use the
# last four; the first three are transformers 5's in-memory layout, accepted in case a
# checkpoint was written that way.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.visual.", "visual."),
    ("audio_tower.", "audio_tower."),
    ("visual.", "visual."),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)


def has_mm_features(inputs: dict[str, Any]) -> bool:
    return any(inputs.get(k) is not None for k in ("input_features", "pixel_values", "pixel_values_videos"))


def audio_lengths(inputs: dict[str, Any]) -> torch.Tensor | None:
    """Valid mel frames per audio, or None without audio."""
    features, lengths = inputs.get("input_features"), inputs.get("audio_feature_lengths")
    if features is None and lengths is None:
        return None
    return audio_feature_lengths(features, inputs.get("feature_attention_mask"), lengths)


def rope_index_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The media keyword arguments of both generations' M-RoPE index functions, read from
    `request.model_inputs`."""
    return dict(
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        audio_seqlens=audio_lengths(inputs),
        second_per_grids=inputs.get("video_second_per_grid"),
        use_audio_in_video=bool(inputs.get("use_audio_in_video", False)),
    )


class OmniThinkerForCausalLM(DecoderForCausalLM):
    """A thinker's decoder LM with its encoders (`audio_tower`, `visual`), loaded from the whole
    Omni checkpoint (`whole_omni_checkpoint`: only `thinker.*` is ours) or a thinker-only one."""

    whole_omni_checkpoint: bool

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith("thinker."):
            name = name[len("thinker.") :]
        elif self.whole_omni_checkpoint:
            return None  # talker.* / token2wav.* / code2wav.*: other stages of the same checkpoint
        # else a thinker-only checkpoint: transformers saves it with or without `thinker.`
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                local = ours + name[len(prefix) :]
                break
        else:
            return name, None  # a thinker tensor we do not know: the strict loader reports it
        if local.startswith(("audio_tower.", "visual.")):
            # HF modules under their own names; inv_freq is a derived buffer some checkpoints carry.
            return None if local.endswith(".inv_freq") else (local, None)
        return super().map_weight_name(local)
