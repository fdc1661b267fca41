"""What the Qwen2.5-Omni and Qwen3-Omni thinkers share: their checkpoint layout and their typed
media inputs (`request.model_inputs`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_omni.model_executor.models.decoder import DecoderForCausalLM
from vllm_omni.model_executor.models.towers import audio_feature_lengths

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


# The entry stage also receives what later stages read from the same prompt (the voice).
_FOR_LATER_STAGES = frozenset({"speaker"})


@dataclass(frozen=True)
class ThinkerMediaInputs:
    """A thinker request's processed media (the input processor's flat tensors), parsed once
    when the request is added. Shapes:
      input_features [num_audios, mel, frames] + feature_attention_mask [num_audios, frames]
        (or audio_feature_lengths [num_audios]);
      pixel_values [patches, C*T*P*P] + image_grid_thw [num_images, 3];
      pixel_values_videos + video_grid_thw [num_videos, 3] + video_second_per_grid [num_videos]."""

    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    audio_feature_lengths: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    use_audio_in_video: bool = False

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> ThinkerMediaInputs | None:
        """None for a text-only request. ValueError names an unknown key or a non-tensor."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(info) - fields - _FOR_LATER_STAGES)
        if unknown:
            raise ValueError(f"unknown thinker inputs {unknown}; known: {sorted(fields)}")
        values = {k: v for k, v in info.items() if k in fields and v is not None}
        for key, value in values.items():
            if key != "use_audio_in_video" and not isinstance(value, torch.Tensor):
                raise ValueError(f"thinker input {key!r} must be a tensor, got {type(value).__name__}")
        values["use_audio_in_video"] = bool(values.get("use_audio_in_video", False))
        inputs = cls(**values)
        return inputs if inputs.has_media else None

    @property
    def has_media(self) -> bool:
        return any(t is not None for t in (self.input_features, self.pixel_values, self.pixel_values_videos))

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        """Valid mel frames per audio, or None without audio."""
        if self.input_features is None and self.audio_feature_lengths is None:
            return None
        return audio_feature_lengths(self.input_features, self.feature_attention_mask, self.audio_feature_lengths)

    def rope_index_kwargs(self) -> dict[str, Any]:
        """The media keyword arguments of both generations' M-RoPE index functions."""
        return dict(image_grid_thw=self.image_grid_thw, video_grid_thw=self.video_grid_thw,
                    audio_seqlens=self.audio_lengths, second_per_grids=self.video_second_per_grid,
                    use_audio_in_video=self.use_audio_in_video)


class OmniThinkerForCausalLM(DecoderForCausalLM):
    """A thinker's decoder LM with its encoders (`audio_tower`, `visual`), loaded from the whole
    Omni checkpoint (`whole_omni_checkpoint`: only `thinker.*` is ours) or a thinker-only one."""

    whole_omni_checkpoint: bool
    uses_mrope: ClassVar[bool] = True
    embeds_requests: ClassVar[bool] = True

    def parse_request_inputs(self, info: Mapping[str, Any]) -> ThinkerMediaInputs | None:
        return ThinkerMediaInputs.from_info(info)

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
