"""Audio and vision encoders of the Qwen2.5-Omni thinker.

Thin wrappers around transformers' `Qwen2_5OmniAudioEncoder` / `Qwen2_5OmniVisionEncoder`
(DESIGN section 5: encoders may start as HF modules, loaded from the same checkpoint under
their HF names). They run once per request, so they are not on the decode hot path.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniVisionEncoder,
)

from vllm_omni.model_executor.models.qwen2_5_omni.positions import audio_output_length
from vllm_omni.model_executor.models.towers import build_tower


def build_audio_tower(audio_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen2_5OmniAudioEncoder, audio_config)


def build_vision_tower(vision_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen2_5OmniVisionEncoder, vision_config)


def _param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


def encode_audio(tower: nn.Module, input_features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """input_features [num_audios, mel, frames] (right-padded), lengths [num_audios] ->
    [sum of audio tokens, output_dim], in order (HF `get_audio_features`)."""
    weight = _param(tower)
    lengths = lengths.to(weight.device)
    valid = torch.arange(input_features.shape[-1], device=weight.device)[None, :] < lengths[:, None]
    # The tower takes the valid frames of all audios concatenated: [mel, total_frames].
    features = input_features.to(weight.device).permute(0, 2, 1)[valid].permute(1, 0)
    out = tower(features, feature_lens=lengths, aftercnn_lens=(lengths - 1) // 2 + 1).last_hidden_state
    expected = sum(audio_output_length(int(n)) for n in lengths.tolist())
    if out.shape[0] != expected:
        raise ValueError(f"audio encoder returned {out.shape[0]} tokens, expected {expected}")
    return out


def encode_vision(tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Flattened patches [num_patches, C*T*P*P] of all images (or all videos), grid_thw [n, 3] ->
    merged tokens [sum(t*h*w) / merge^2, out_hidden_size], in order (HF `get_image_features`)."""
    weight = _param(tower)
    grid_thw = torch.as_tensor(grid_thw).to(weight.device)
    out = tower(pixel_values.to(device=weight.device, dtype=weight.dtype), grid_thw=grid_thw)
    return out.pooler_output
