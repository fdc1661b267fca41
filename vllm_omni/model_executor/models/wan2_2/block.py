"""A Wan transformer block for torch.compile: diffusers' weights, the same math.

`CompilableWanBlock` runs a diffusers WanTransformerBlock's own submodules in the same order,
in three compiled parts around the two attentions (self-attention over the video tokens, then
cross-attention to the prompt), which run eagerly on the stage's attention kernel:

- The float32 work diffusers does as separate kernels over [tokens, dim] tensors (the layer
  norms, the modulation by the timestep's shift / scale / gate, the gated residuals) fuses into
  the GEMMs' neighbours.
- RoPE in real arithmetic on (cos, sin) tables, one pointwise expression over the (even, odd)
  pairs (diffusers writes the even and odd halves into an empty tensor, in float64 where its
  tables are float64).
- The MLP's tanh GELU in the first GEMM's epilogue (diffusion_acceleration.fused_gelu_mlp).
- A TI2V-5B batch's per-token modulation is per latent frame (denoiser.embed, `per_frame`):
  the hidden states are viewed [rows, frames, tokens per frame, dim] against [rows, frames, 1, dim].
- The self-attention is pluggable (`attend`): with sequence parallelism a rank runs the block on
  its slice of the video tokens and `sequence_parallel_self_attention` attends over all of them;
  the cross-attention's queries are the rank's own tokens and its keys the whole prompt.

The result equals the diffusers block up to float rounding; the GPU suite compares the two.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.models.diffusion_acceleration import fused_gelu_mlp
from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelAttention, SequencePlan
from vllm_omni.model_executor.models.diffusion_attention import AttentionSite

SelfAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionSite | None], torch.Tensor]


def real_rope(rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' (cos, sin) tables [1, S, 1, D] (each value repeated for the pair) as float32
    cos [1, S, 1, D/2, 1] and (-sin, sin) [1, S, 1, D/2, 2]."""
    cos, sin = rotary[0][..., 0::2].float().unsqueeze(-1), rotary[1][..., 1::2].float().unsqueeze(-1)
    return cos.contiguous(), torch.cat([-sin, sin], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]: (x1 cos - x2 sin, x1 sin + x2 cos) for each (even x1, odd x2) pair."""
    pairs = x.float().unflatten(-1, (-1, 2))
    return (pairs * cos + pairs.flip(-1) * signed_sin).flatten(-2).type_as(x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, site: AttentionSite | None = None) -> torch.Tensor:
    """SDPA on [B, S, H, D] tensors through heads-first views; [B, S, H * D]. `site`: this
    attention's settings (kernel, FP8 K/V; models/diffusion_attention.py), None: the caller's."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if site is None:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        k, v = site.kv(k, v)
        with site.kernel(q.device):
            out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2, 3).type_as(q)


def sequence_parallel_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     site: AttentionSite | None = None, *, attention: SequenceParallelAttention,
                                     plan: SequencePlan) -> torch.Tensor:
    """_attention over the video tokens split across the sequence-parallel ranks: this rank's
    queries, keys and values in, its tokens' output out ([B, S_local, H * D]). A `site`'s FP8 K/V
    scales take their absmax over every rank's tokens (as one process over all of them)."""
    if site is not None:
        k, v = (x.transpose(1, 2) for x in site.kv(k.transpose(1, 2), v.transpose(1, 2), plan.group.all_max))
    with site.kernel(q.device) if site is not None else contextlib.nullcontext():
        out = attention(q, k, v, plan)
    return out.flatten(2, 3).type_as(q)


def _modulation(block: Any, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six [rows, T, 1, dim] float32 modulations of diffusers' block from [rows, T, 6, dim]."""
    return (block.scale_shift_table.unsqueeze(0) + proj.float()).chunk(6, dim=2)


class CompilableWanBlock(nn.Module):
    def __init__(self, block: Any, compile_fn: Any = None, sites: tuple[AttentionSite, AttentionSite] | None = None) -> None:
        super().__init__()
        self.block = block
        self.self_site, self.cross_site = sites or (None, None)
        compile_fn = compile_fn or (lambda f: f)
        self.before_self_attention = compile_fn(self._before_self_attention)
        self.before_cross_attention = compile_fn(self._before_cross_attention)
        self.after_cross_attention = compile_fn(self._after_cross_attention)

    def forward(self, hidden: torch.Tensor, encoder: torch.Tensor, proj: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], attend: SelfAttend = _attention) -> torch.Tensor:
        """hidden [rows, tokens, dim]; proj [rows, T, 6, dim] with T dividing tokens (1, frames, or
        a rank's tokens); `attend`: the self-attention, _attention or its sequence-parallel form."""
        q, k, v = self.before_self_attention(hidden, proj, *rope)
        hidden, q, k, v = self.before_cross_attention(attend(q, k, v, self.self_site), hidden, encoder, proj)
        return self.after_cross_attention(_attention(q, k, v, self.cross_site), hidden, proj)

    def _before_self_attention(self, hidden: torch.Tensor, proj: torch.Tensor, cos: torch.Tensor,
                               signed_sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, attn = self.block, self.block.attn1
        shift, scale = _modulation(b, proj)[:2]
        x = (b.norm1(_grouped(hidden, proj).float()) * (1 + scale) + shift).type_as(hidden).flatten(1, 2)
        q = _rotate(attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1)), cos, signed_sin)
        k = _rotate(attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1)), cos, signed_sin)
        return q, k, attn.to_v(x).unflatten(2, (attn.heads, -1))

    def _before_cross_attention(self, out: torch.Tensor, hidden: torch.Tensor, encoder: torch.Tensor,
                                proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, attn1, attn = self.block, self.block.attn1, self.block.attn2
        gate = _modulation(b, proj)[2]
        update = _grouped(attn1.to_out[0](out), proj) * gate
        hidden = (_grouped(hidden, proj).float() + update).type_as(hidden).flatten(1, 2)
        x = b.norm2(hidden.float()).type_as(hidden)
        q = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(encoder)).unflatten(2, (attn.heads, -1))
        return hidden, q, k, attn.to_v(encoder).unflatten(2, (attn.heads, -1))

    def _after_cross_attention(self, out: torch.Tensor, hidden: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        b = self.block
        shift, scale, gate = _modulation(b, proj)[3:]
        hidden = hidden + b.attn2.to_out[0](out)
        x = (b.norm3(_grouped(hidden, proj).float()) * (1 + scale) + shift).type_as(hidden).flatten(1, 2)
        update = _grouped(fused_gelu_mlp(b.ffn, x).float(), proj) * gate
        return (_grouped(hidden, proj).float() + update).type_as(hidden).flatten(1, 2)


def _grouped(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """[rows, tokens, dim] as [rows, T, tokens / T, dim], T = proj's modulation groups."""
    return x.view(x.shape[0], proj.shape[1], -1, x.shape[-1])
