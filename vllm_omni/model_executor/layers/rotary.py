"""Rotary position embeddings (neox style, `rotate_half`), numerically as in transformers.

HF computes `inv_freq` once in float32, then per forward `freqs = pos.float() * inv_freq`,
`cos/sin` in float32, cast to the activation dtype, and `x * cos + rotate_half(x) * sin`
in that dtype. We precompute the same float32 `cos(freqs)` / `sin(freqs)` for every
position up to `max_position` (a product and a cos of identical float32 inputs give
identical results) and gather rows by position, so outputs match HF bit for bit.

Subclasses change how positions map to frequencies by overriding `cos_sin`:
`MRotaryEmbedding` (M-RoPE, positions [3, T] = temporal/height/width rows, `mrope_section`,
contiguous as in Qwen2-VL / Qwen2.5-Omni or interleaved as in Qwen3-Omni) is built by
`get_rope` when the parameters carry `mrope_section`.
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
    """x: [T, H, D]; cos/sin: [T, D] in x's dtype. On CUDA, rotates x in place (one kernel)."""
    if x.is_cuda and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0):
        from vllm_omni.model_executor.layers import cuda_ops

        return cuda_ops.rotary_(x, cos, sin)
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


def mrope_axis_map(mrope_section: list[int], half_dim: int, interleaved: bool) -> torch.Tensor:
    """For each of the `half_dim` frequencies, which position row (0=t, 1=h, 2=w) drives it.

    Contiguous (HF Qwen2.5-Omni `recomposition_frequencies`): section i of `mrope_section`
    takes row i % 3. Interleaved (HF Qwen3-Omni): start from all-t, then frequencies
    1, 4, 7, ... below 3 * section[1] take h and 2, 5, 8, ... below 3 * section[2] take w.
    """
    if len(mrope_section) != 3 or sum(mrope_section) != half_dim:
        raise ValueError(f"mrope_section {mrope_section} must have 3 entries summing to head_dim / 2 = {half_dim}")
    if not interleaved:
        rows = [i % 3 for i, size in enumerate(mrope_section) for _ in range(size)]
        return torch.tensor(rows, dtype=torch.long, device="cpu")
    axis = torch.zeros(half_dim, dtype=torch.long, device="cpu")
    for row in (1, 2):
        axis[row : min(3 * mrope_section[row], half_dim) : 3] = row
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: positions [3, T] (t, h, w); each frequency takes its angle from one row.

    Every frequency still sees `pos * inv_freq` of a single position, so gathering the
    per-row rows of the same float32 cos/sin cache keeps HF's bits. Positions [T] (text
    only, or a caller that has no 3D positions) mean three equal rows: plain RoPE.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, mrope_section: list[int], interleaved: bool):
        super().__init__(head_dim, theta, max_position)
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        axis = mrope_axis_map(self.mrope_section, head_dim // 2, interleaved)
        self.register_buffer("axis", axis.to(self.cos_cache.device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] or [T] -> (cos, sin), each [T, D] in `dtype`."""
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [3, T] or [T], got {tuple(positions.shape)}")
        index = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_cache[positions].gather(0, index)[0]  # [T, D/2]
        sin = self.sin_cache[positions].gather(0, index)[0]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}, interleaved={self.interleaved}"


def get_rope(
    head_dim: int, rope_parameters: dict[str, Any], max_position: int, *, mrope_interleaved: bool | None = None
) -> RotaryEmbedding:
    """Build the rotary embedding an HF `config.rope_parameters` dict describes.

    With `mrope_section` it is M-RoPE; the layout is interleaved when the parameters say
    `interleaved` / `mrope_interleaved`, unless `mrope_interleaved` overrides it (HF's
    Qwen3-Omni interleaves whatever its config says).
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (rope_parameters={rope_parameters}); "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if "rope_theta" not in rope_parameters:
        raise ValueError(f"rope_parameters has no rope_theta: {rope_parameters}")
    theta = float(rope_parameters["rope_theta"])
    if "mrope_section" in rope_parameters:
        if mrope_interleaved is None:
            mrope_interleaved = bool(rope_parameters.get("interleaved") or rope_parameters.get("mrope_interleaved"))
        return MRotaryEmbedding(head_dim, theta, max_position, rope_parameters["mrope_section"], mrope_interleaved)
    return RotaryEmbedding(head_dim, theta, max_position)
