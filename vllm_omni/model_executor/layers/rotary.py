"""Rotary position embeddings (neox style, `rotate_half`), numerically as in transformers.

HF computes `inv_freq` once in float32, then per forward `freqs = pos.float() * inv_freq`,
`cos/sin` in float32, cast to the activation dtype, and `x * cos + rotate_half(x) * sin`
in that dtype. We precompute the same float32 `cos(freqs)` / `sin(freqs)` for every
position up to `max_position` (a product and a cos of identical float32 inputs give
identical results) and gather rows by position, so outputs match HF bit for bit.

Subclasses change how positions map to frequencies by overriding `cos_sin`: M-RoPE
(positions [3, T], `mrope_section`, optionally interleaved as in Qwen3-Omni) belongs
here as such a subclass, built by `get_rope` when the parameters carry `mrope_section`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default",)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # Computed on CPU in float32 like HF's `compute_default_rope_parameters`, whatever the
    # default device/dtype at model construction, so every device starts from the same bits.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    return 1.0 / (theta**exponent)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D] in x's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Standard RoPE over the full head dim (rope_type "default"); positions [T]."""

    def __init__(self, head_dim: int, theta: float, max_position: int):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = default_inv_freq(head_dim, theta).to(torch.get_default_device())
        positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        # float32 regardless of the model dtype; cast per use like HF. Non-persistent:
        # derived data, never in a checkpoint.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, D] in `dtype`."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        # HF's emb = cat(freqs, freqs): both halves of a pair share one frequency.
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H*D] or [T, H, D], k likewise; returns them rotated, same shapes."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, k, cos, sin)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q_rot = apply_rotary_emb(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = apply_rotary_emb(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.view_as(q), k_rot.view_as(k)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def get_rope(head_dim: int, rope_parameters: dict[str, Any], max_position: int) -> RotaryEmbedding:
    """Build the rotary embedding an HF `config.rope_parameters` dict describes."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (rope_parameters={rope_parameters}); "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if "mrope_section" in rope_parameters:
        raise ValueError(f"M-RoPE (mrope_section={rope_parameters['mrope_section']}) is not implemented yet")
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if "rope_theta" not in rope_parameters:
        raise ValueError(f"rope_parameters has no rope_theta: {rope_parameters}")
    return RotaryEmbedding(head_dim, float(rope_parameters["rope_theta"]), max_position)
