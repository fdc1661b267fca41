"""Audio and vision encoders of the Qwen2.5-Omni thinker.

Thin wrappers around transformers' `Qwen2_5OmniAudioEncoder` / `Qwen2_5OmniVisionEncoder`
(DESIGN section 5: encoders may start as HF modules, loaded from the same checkpoint under
their HF names). They run once per request, so they are not on the decode hot path.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniVisionEncoder,
)

from vllm_omni.model_executor.models.qwen2_5_omni.positions import audio_output_length

try:  # present in transformers 5.x; skipping the random init saves ~20 s at 7B size on CPU
    from transformers.initialization import no_init_weights
except ImportError:  # pragma: no cover - older transformers
    from contextlib import nullcontext as no_init_weights


def build_tower(cls: type, sub_config: PretrainedConfig) -> nn.Module:
    """An HF encoder in the current default dtype/device, parameters left for the loader to fill.

    The config is copied because `_from_config` writes the dtype into it; the dtype is passed
    explicitly because it would otherwise follow the checkpoint config instead of the engine's.
    """
    with no_init_weights():
        tower = cls._from_config(copy.deepcopy(sub_config), dtype=torch.get_default_dtype())
    return tower.requires_grad_(False)


def build_audio_tower(audio_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen2_5OmniAudioEncoder, audio_config)


def build_vision_tower(vision_config: PretrainedConfig) -> nn.Module:
    return build_tower(Qwen2_5OmniVisionEncoder, vision_config)


def _param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


def audio_feature_lengths(
    input_features: torch.Tensor,
    feature_attention_mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Valid mel frames per audio: the mask's row sums, else the given lengths, else all frames."""
    if feature_attention_mask is not None:
        return feature_attention_mask.sum(dim=1).long()
    if lengths is not None:
        return torch.as_tensor(lengths, dtype=torch.long)
    return torch.full((input_features.shape[0],), input_features.shape[-1], dtype=torch.long)


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
