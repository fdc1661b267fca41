"""Audio and vision encoders of the Qwen3-Omni thinker.

Thin wrappers around transformers' `Qwen3OmniMoeAudioEncoder` / `Qwen3OmniMoeVisionEncoder`
(loaded from the same checkpoint under their HF names, random init skipped: see
models/towers.py). They run once per request, off the decode hot path.

The vision encoder also returns DeepStack features: one merged [tokens, H] map per entry of
`deepstack_visual_indexes`, which the decoder adds to the hidden states of the image/video
tokens after its first layers (see deepstack.py).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)

from vllm_omni.model_executor.models.towers import audio_feature_lengths, build_tower
from vllm_omni.model_executor.models.qwen3_omni.rope_index import audio_output_length

__all__ = ["audio_feature_lengths", "build_audio_tower", "build_vision_tower", "encode_audio", "encode_vision"]


def build_audio_tower(audio_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen3OmniMoeAudioEncoder, audio_config)


def build_vision_tower(vision_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen3OmniMoeVisionEncoder, vision_config)


def _param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


def encode_audio(tower: nn.Module, input_features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """input_features [num_audios, mel, frames] (right-padded), lengths [num_audios] ->
    [sum of audio tokens, output_dim], in order (HF `get_audio_features`)."""
    device = _param(tower).device
    lengths = lengths.to(device)
    valid = torch.arange(input_features.shape[-1], device=device)[None, :] < lengths[:, None]
    # The tower takes the valid frames of all audios concatenated, [mel, total_frames], in the
    # processor's dtype (it casts to its own after padding, as HF's call does).
    features = input_features.to(device).permute(0, 2, 1)[valid].permute(1, 0)
    out = tower(features, feature_lens=lengths).last_hidden_state
    expected = sum(audio_output_length(int(n), tower.config.n_window) for n in lengths.tolist())
    if out.shape[0] != expected:
        raise ValueError(f"audio encoder returned {out.shape[0]} tokens, expected {expected}")
    return out


def encode_vision(
    tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened patches [num_patches, C*T*P*P] of all images (or all videos), grid_thw [n, 3] ->
    (merged tokens [N, out_hidden], DeepStack features [len(deepstack_visual_indexes), N, out_hidden]),
    N = sum(t*h*w) / merge^2, in order (HF `get_image_features`)."""
    weight = _param(tower)
    grid_thw = torch.as_tensor(grid_thw).to(weight.device)
    out = tower(pixel_values.to(device=weight.device, dtype=weight.dtype), grid_thw=grid_thw)
    if isinstance(out, tuple):  # transformers releases that return (merged, deepstack list)
        merged, deepstack = out[0], out[1]
    else:
        merged, deepstack = out.pooler_output, out.deepstack_features
    if not deepstack:  # no deepstack_visual_indexes: an empty [0, N, H] stack
        return merged, merged.new_empty(0, *merged.shape)
    return merged, torch.stack(list(deepstack))
