"""A Qwen-Image transformer block for torch.compile: diffusers' weights, the same math.

`CompilableBlock` runs a diffusers QwenImageTransformerBlock's own submodules (modulation, norms,
projections, MLPs) in the same order, in two compiled halves around the attention:

- RoPE in real arithmetic on (cos, sin) tables: diffusers multiplies complex tensors, which
  inductor cannot fuse, so each of its four RoPE calls would run as separate kernels over
  float32 copies of q and k.
- The joint attention runs between the halves, unmasked: a batch whose prompts differ in length
  is padded, and instead of the padding mask (cuDNN's masked kernel is ~45% slower on the H200)
  each run of rows with one prompt length attends over its own valid tokens. The sequence is
  ordered [image, text] so that a row's valid tokens are a prefix (a slice, not a copy).
  Padded text positions get zeros: they are never keys and never reach the output.

Every projection still sees the whole batch (one GEMM for all rows). The result equals the
diffusers block up to float rounding; the GPU suite compares the two.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelAttention, SequencePlan
from vllm_omni.model_executor.models.diffusion_acceleration import fused_gelu_mlp
from vllm_omni.model_executor.models.diffusion_attention import AttentionSite

Runs = Sequence[tuple[int, int, int]]  # (first row, end row, valid text length) of rows sharing a prompt length
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, AttentionSite | None], torch.Tensor]


def real_rope(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' complex RoPE table [S, D/2] as float32 (cos [S, 1, D/2, 1], (-sin, sin) [S, 1, D/2, 2]),
    broadcast over heads and over each (even, odd) pair."""
    cos, sin = freqs.real.float()[:, None, :, None], freqs.imag.float()[:, None, :, None]
    return cos.contiguous(), torch.cat([-sin, sin], dim=-1)


def length_runs(lengths: Sequence[int]) -> Runs:
    """Consecutive rows with the same prompt length, as (start, end, length)."""
    runs: list[tuple[int, int, int]] = []
    for row, n in enumerate(lengths):
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], row + 1, n)
        else:
            runs.append((row, row + 1, n))
    return runs


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with (even, odd) pairs as complex numbers (re, im), times cos + i sin:
    (re cos - im sin, im cos + re sin), written as one pointwise expression over the pairs."""
    pairs = x.float().unflatten(-1, (-1, 2))
    return (pairs * cos + pairs.flip(-1) * signed_sin).flatten(-2).type_as(x)


def _modulate(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shift, scale, gate = params.chunk(3, dim=-1)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                    site: AttentionSite | None = None, *, text_tokens: int, runs: Runs) -> torch.Tensor:
    """SDPA over [B, S, H, D] tensors in [image, text] order; each run attends over its valid
    prefix. SDPA takes heads-first views and returns a view of a [B, S, H, D] buffer (its
    layout follows the query's), so no transpose is copied on either side. `site`: the block's
    attention settings (kernel, FP8 K/V; models/diffusion_attention.py), None: the caller's."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if site is not None:
        k, v = site.kv(k, v)
        with site.kernel(q.device):
            return _runs_attention(q, k, v, image_tokens, text_tokens, runs)
    return _runs_attention(q, k, v, image_tokens, text_tokens, runs)


def _runs_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int, text_tokens: int,
                    runs: Runs) -> torch.Tensor:
    if len(runs) == 1 and runs[0][2] == text_tokens:  # no padding
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    out = torch.zeros_like(q)
    for start, end, length in runs:
        valid = image_tokens + length
        out[start:end, :, :valid] = F.scaled_dot_product_attention(
            q[start:end, :, :valid], k[start:end, :, :valid], v[start:end, :, :valid])
    return out.transpose(1, 2)


def sequence_parallel_joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                                      site: AttentionSite | None = None, *, attention: SequenceParallelAttention,
                                      plan: SequencePlan, runs: Runs) -> torch.Tensor:
    """joint_attention with the image tokens split across the sequence-parallel ranks: this rank's
    `image_tokens` image tokens, then the whole prompt (every rank holds it). The prompt's valid
    tokens join each run's attention as the wrapper's joint tokens (layers/sequence_parallel.py).
    A `site`'s FP8 K/V scales take their absmax over every rank's tokens (as one process over all)."""
    if site is not None:
        k, v = (x.transpose(1, 2) for x in site.kv(k.transpose(1, 2), v.transpose(1, 2), plan.group.all_max))
    out = torch.zeros_like(q)
    with site.kernel(q.device) if site is not None else contextlib.nullcontext():
        for start, end, length in runs:
            rows, text = slice(start, end), slice(image_tokens, image_tokens + length)
            out[rows, :image_tokens], out[rows, text] = attention(
                q[rows, :image_tokens], k[rows, :image_tokens], v[rows, :image_tokens], plan,
                joint=(q[rows, text], k[rows, text], v[rows, text]))
    return out


class CompilableBlock(nn.Module):
    def __init__(self, block: Any, compile_fn: Any = None, site: AttentionSite | None = None) -> None:
        super().__init__()
        self.block = block
        self.site = site
        compile_fn = compile_fn or (lambda f: f)
        self.before_attention = compile_fn(self._before_attention)
        self.after_attention = compile_fn(self._after_attention)

    def forward(self, hidden: torch.Tensor, encoder: torch.Tensor, temb: torch.Tensor,
                rope: tuple[torch.Tensor, ...], attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend(q, k, v, image_tokens, site)`: joint_attention or its sequence-parallel form,
        bound to the forward's prompt lengths."""
        q, k, v, img_gate1, img_mod2, txt_gate1, txt_mod2 = self.before_attention(hidden, encoder, temb, rope)
        out = attend(q, k, v, hidden.shape[1], self.site)
        return self.after_attention(out, hidden, encoder, img_gate1, img_mod2, txt_gate1, txt_mod2)

    def _before_attention(self, hidden: torch.Tensor, encoder: torch.Tensor, temb: torch.Tensor,
                          rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        b, attn = self.block, self.block.attn
        img_mod1, img_mod2 = b.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = b.txt_mod(temb).chunk(2, dim=-1)
        img, img_gate1 = _modulate(b.img_norm1(hidden), img_mod1)
        txt, txt_gate1 = _modulate(b.txt_norm1(encoder), txt_mod1)
        head_dim = attn.inner_dim // attn.heads
        img_cos, img_sin, txt_cos, txt_sin = rope

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        q_img = _rotate(attn.norm_q(heads(attn.to_q(img))), img_cos, img_sin)
        k_img = _rotate(attn.norm_k(heads(attn.to_k(img))), img_cos, img_sin)
        q_txt = _rotate(attn.norm_added_q(heads(attn.add_q_proj(txt))), txt_cos, txt_sin)
        k_txt = _rotate(attn.norm_added_k(heads(attn.add_k_proj(txt))), txt_cos, txt_sin)
        v_img, v_txt = heads(attn.to_v(img)), heads(attn.add_v_proj(txt))
        q, k, v = (torch.cat(pair, dim=1) for pair in ((q_img, q_txt), (k_img, k_txt), (v_img, v_txt)))
        return q, k, v, img_gate1, img_mod2, txt_gate1, txt_mod2

    def _after_attention(self, out: torch.Tensor, hidden: torch.Tensor, encoder: torch.Tensor,
                         img_gate1: torch.Tensor, img_mod2: torch.Tensor, txt_gate1: torch.Tensor,
                         txt_mod2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, attn = self.block, self.block.attn
        out = out.flatten(2, 3).to(hidden.dtype)
        seq_img = hidden.shape[1]
        hidden = hidden + img_gate1 * attn.to_out[0](out[:, :seq_img].contiguous())
        encoder = encoder + txt_gate1 * attn.to_add_out(out[:, seq_img:].contiguous())
        img, img_gate2 = _modulate(b.img_norm2(hidden), img_mod2)
        hidden = hidden + img_gate2 * fused_gelu_mlp(b.img_mlp, img)
        txt, txt_gate2 = _modulate(b.txt_norm2(encoder), txt_mod2)
        encoder = encoder + txt_gate2 * b.txt_mlp(txt)
        if hidden.dtype == torch.float16:  # as diffusers: keep float16 finite
            encoder, hidden = encoder.clip(-65504, 65504), hidden.clip(-65504, 65504)
        return encoder, hidden
