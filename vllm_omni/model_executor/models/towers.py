"""What the thinkers' encoder towers share (Qwen2.5-Omni's and Qwen3-Omni's, both transformers'
modules loaded from the checkpoint under their HF names)."""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

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
