"""Qwen2.5-Omni token2wav DiT: transformers' flow-matching `sample`, for a batch of rows of
different lengths, each from its own noise.

transformers' `Qwen2_5OmniToken2WavDiTModel.forward` has no padding mask (its block
attention spans a whole batch row), and `sample` draws its noise inside. This module runs
the same submodules (the checkpoint's weights) with:

- right padding and a mask that keeps real positions and padding apart, so a row's mel
  depends only on its own codes, speaker and noise, whatever shares its batch;
- the speaker encoder run once per voice instead of in every solver evaluation (it sees
  only the reference mel, the same each time);
- each row's noise given (token2wav_noise.py: transformers' draw, from the request's own
  generator, whole or in a stream's windows);
- attention computed block by block (`_window_attention`): each layer's mask lets a query
  block see only its own block and at most one block behind or ahead, so transformers' full
  [T, T] masked attention spends nearly all its work on pairs it then masks (20% of the GPU
  time of 8 streamed windows on the H200). Same pairs, same softmax: the outputs differ from
  the full attention only by float summation order. On CUDA one kernel per layer does it;
- the time's conditioning (the time embedding and every layer's adaptive-norm modulation, the
  same for all rows) computed once per ODE schedule (`_ode_steps`) rather than in each of a
  chunk's 36 evaluations for each row: 22 products and their ~0.5 GB of weights per evaluation.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# transformers' Qwen2_5OmniToken2WavModel.forward defaults.
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0


@dataclass(frozen=True)
class DiTRow:
    """One row of a DiT batch: a request, or a window of a stream."""

    codes: torch.Tensor  # [L] codec codes (CPU, long)
    noise: torch.Tensor  # [L * repeats, mel_dim] the ODE's start (CPU, float32)
    speaker_embedding: torch.Tensor  # [enc_emb_dim] the voice's `cond`
    speaker_features: torch.Tensor  # [2, enc_dim] speaker encoder of its ref_mel, then of zeros


def speaker_features(dit, ref_mel: torch.Tensor) -> torch.Tensor:
    """[2, enc_dim]: what transformers' input embedding computes in every evaluation, once:
    the speaker encoder of the reference mel (guided half) and of zeros (unguided half)."""
    return dit.input_embed.spk_encoder(torch.cat([ref_mel, torch.zeros_like(ref_mel)]))


def sample_mel(dit, rows: list[DiTRow], num_steps: int, device: torch.device, bf16: bool = False,
               forward: Callable[..., torch.Tensor] | None = None) -> list[torch.Tensor]:
    """transformers' `sample` (RK4 flow matching, classifier-free guidance 0.5, sway -1) for
    rows of any lengths in one batch; returns each row's mel [frames, mel_dim] (float32, CPU).
    `bf16`: the DiT evaluations under bfloat16 autocast; the ODE state stays float32.
    `forward`: `forward_cfg` or a compiled version of it."""
    forward = forward or forward_cfg
    lengths = [r.noise.shape[0] for r in rows]
    longest, batch, repeats = max(lengths), len(rows), dit.repeats
    noise = torch.zeros(batch, longest, dit.mel_dim)
    codes = torch.zeros(batch, longest // repeats, dtype=torch.long)
    for i, row in enumerate(rows):
        noise[i, : lengths[i]] = row.noise
        codes[i, : row.codes.numel()] = row.codes
    codes = codes.to(device)
    speaker = torch.stack([r.speaker_embedding for r in rows]).to(device, torch.float32)
    feats = torch.stack([r.speaker_features for r in rows]).to(device, torch.float32)  # [B, 2, enc_dim]
    feats = torch.cat([feats[:, 0], feats[:, 1]])  # guided rows, then unguided rows (transformers' order)
    lengths_on_device = torch.tensor(lengths, device=device)

    def velocity(conditioning: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = forward(dit, x, conditioning, codes, speaker, feats, lengths_on_device)
        guided, unguided = torch.chunk(out.float(), 2, dim=0)
        return guided + (guided - unguided) * GUIDANCE_SCALE

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        steps = _ode_steps(dit, num_steps, device, bf16)
        mel = noise.to(device)
        for step, conditionings in steps:  # transformers' RungeKutta4ODESolver, its arithmetic in order
            k1 = velocity(conditionings[0], mel)
            k2 = velocity(conditionings[1], mel + step * k1 * (1 / 3))
            k3 = velocity(conditionings[2], mel + step * (k2 - k1 * (1 / 3)))
            k4 = velocity(conditionings[3], mel + step * (k1 - k2 + k3))
            mel = mel + (k1 + 3 * (k2 + k3) + k4) * step / 8
    mel = mel.float().cpu()
    return [mel[i, :n] for i, n in enumerate(lengths)]


_MAX_CACHED_SCHEDULES = 8  # per DiT: distinct (num_steps, device, bf16); a request may choose num_steps


def _ode_steps(dit, num_steps: int, device: torch.device, bf16: bool) -> list[tuple[torch.Tensor, tuple]]:
    """Each RK4 interval's step and the time conditioning of its four evaluations (at its start,
    1/3, 2/3, end), with the times computed as transformers' `sample` and solver compute them.
    The conditioning depends only on the time (and the weights: they must not change after
    the first call), so it is computed once per schedule and kept on the module (in its
    __dict__: plain tensors, no buffers, nothing in its state dict)."""
    cache = dit.__dict__.setdefault("_ode_schedules", {})
    key = (num_steps, str(device), bf16)
    if key not in cache:
        times = torch.linspace(0, 1, num_steps, device=device, dtype=torch.float32)
        times += SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
        steps = []
        for start, end in zip(times[:-1], times[1:]):
            step = end - start
            at = (start, start + step * (1 / 3), start + step * (2 / 3), end)
            steps.append((step, tuple(time_conditioning(dit, t) for t in at)))
        if len(cache) >= _MAX_CACHED_SCHEDULES:
            cache.pop(next(iter(cache)))
        cache[key] = steps
    return cache[key]


def time_conditioning(dit, time: torch.Tensor) -> torch.Tensor:
    """[1, layers * 6 * dim + 2 * dim]: every layer's adaptive-norm modulation and the final
    norm's, from the ODE time (what transformers' DiT computes from the time in each evaluation,
    identical for every row)."""
    embedding = dit.time_embed(time.reshape(1))
    parts = [layer.attn_norm.linear(layer.attn_norm.silu(embedding)) for layer in dit.transformer_blocks]
    parts.append(dit.norm_out.linear(dit.norm_out.silu(embedding)))
    return torch.cat(parts, dim=1)


def forward_cfg(dit, x, conditioning, codes, speaker, feats, lengths) -> torch.Tensor:
    """transformers' DiT forward with apply_cfg=True ([guided rows; unguided rows]), given the
    speaker features, the time's conditioning (`time_conditioning`) and each row's real length
    (`lengths` [B]: frames past it are padding)."""
    rows, frames = x.shape[0], x.shape[1]
    code_embed = torch.cat([dit.text_embed(codes), dit.text_embed(codes, drop_code=True)])
    speaker = torch.cat([speaker, torch.zeros_like(speaker)]).unsqueeze(1).expand(-1, frames, -1)
    feats = feats.unsqueeze(1).expand(-1, frames, -1)
    hidden = dit.input_embed.proj(torch.cat([x.repeat(2, 1, 1), feats, code_embed, speaker], dim=-1))
    positions = torch.arange(frames, device=x.device)[None, :].repeat(2 * rows, 1)
    rope = dit.rotary_embed(hidden, positions)
    lengths = lengths.repeat(2)
    masks: dict[tuple[int, int], torch.Tensor] = {}  # the torch path's, one per (look-back, look-ahead) reach
    width, layers = 6 * hidden.shape[-1], dit.transformer_blocks
    # Per layer: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp [2B, dim] each.
    modulations = [conditioning[:, i * width:(i + 1) * width].expand(2 * rows, -1).chunk(6, dim=1)
                   for i in range(len(layers))]
    final_scale, final_shift = conditioning[:, len(layers) * width:].expand(2 * rows, -1).chunk(2, dim=1)
    # Each layer's input norm is computed with the residual sum before it (the previous layer's
    # last one), so a layer takes `normed` and hands the next layer its own.
    shift, scale = modulations[0][:2]
    normed = _modulated_norm(layers[0].attn_norm.norm, hidden, scale, shift)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            next_norm = (layers[i + 1].attn_norm.norm, modulations[i + 1][1], modulations[i + 1][0])
        else:
            next_norm = (dit.norm_out.norm, final_scale, final_shift)
        hidden, normed = _decoder_layer(layer, hidden, normed, modulations[i], next_norm, rope, lengths, masks,
                                        dit.block_size)
    return dit.proj_out(normed)


def _decoder_layer(layer, hidden, normed, modulation, next_norm, rope, lengths, masks,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `DiTDecoderLayer.forward` from its modulated input norm `normed`, given its
    modulation chunks (its `attn_norm.linear` of the time embedding), with the attention of
    `_window_attention`; returns the layer's output and `next_norm` (norm, scale, shift) of it.
    On CUDA each residual and the norm after it are one kernel (elementwise kernels were a
    quarter of the GPU time of streamed windows)."""
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
    attn = _window_attention(layer.attn, normed, rope, lengths, masks, block_size, layer.look_backward_block,
                             layer.look_ahead_block)
    hidden, normed = _residual_and_norm(hidden, gate_msa, attn, layer.ff_norm, scale_mlp, shift_mlp)
    return _residual_and_norm(hidden, gate_mlp, layer.ff(normed), *next_norm)


def _residual_and_norm(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, norm: torch.nn.LayerNorm,
                       scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate * y, norm(that) * (1 + scale) + shift): a gated residual and the norm that
    reads it, one kernel on CUDA (see `_modulated_norm` for its output dtype)."""
    if x.is_cuda and x.is_contiguous() and y.is_contiguous() and gate.dtype == y.dtype:
        from vllm_omni.model_executor.layers import code2wav_ops

        return code2wav_ops.gated_residual_norm(x, gate, y, scale, shift, norm.eps, _norm_dtype(x))
    total = x + gate.unsqueeze(1) * y
    return total, _modulated_norm(norm, total, scale, shift)


def _modulated_norm(norm: torch.nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """norm(x) * (1 + scale) + shift, scale and shift per batch row."""
    if x.is_cuda and x.is_contiguous():
        from vllm_omni.model_executor.layers import code2wav_ops

        return code2wav_ops.ada_layer_norm(x, scale, shift, norm.eps, _norm_dtype(x))
    return norm(x) * (1 + scale[:, None]) + shift[:, None]


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    """What the CUDA norm kernels write: x's dtype, or under autocast the autocast dtype, since
    only products read a norm and they would cast torch's float32 result to it (same rounding,
    one pass less)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _window_attention(attn, hidden, rope, lengths, masks, block_size: int, back: int, ahead: int) -> torch.Tensor:
    """transformers' `DiTAttention.forward`, each query block attending only to its window:
    `back` blocks before it, its own, `ahead` blocks after (the keys its layer's mask allows).
    On CUDA one kernel (code2wav_ops.dit_window_attention) does the rotary, the windows and the
    softmax; the torch path builds `_window_mask` once per reach into `masks`."""
    frames = hidden.shape[1]
    query, key, value = _projections(attn, hidden)
    head_dim = query.shape[-1] // attn.heads
    if hidden.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0:  # tl.dot: a power of 2, >= 16
        from vllm_omni.model_executor.layers import code2wav_ops

        cos, sin = rope
        out = code2wav_ops.dit_window_attention(query, key, value, cos[0], sin[0], lengths, attn.heads, block_size,
                                                back, ahead)
        return attn.to_out[0](out)
    if (back, ahead) not in masks:
        masks[back, ahead] = _window_mask(lengths, frames, block_size, back, ahead)
    return attn.to_out[0](_torch_window_attention(attn, query, key, value, rope, masks[back, ahead], block_size,
                                                  back, ahead))


_JOINED_QKV = "joined_qkv"  # the attention module's (weight, bias) of q, k, v joined (fuse_projections)


def _projections(attn, hidden) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [rows, frames, heads * head_dim]: one product when `fuse_projections` joined
    the three weights (views of one column block each), else three."""
    joined = getattr(attn, _JOINED_QKV, None)
    if joined is None:
        return attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    return F.linear(hidden, *joined).chunk(3, dim=-1)


def prepare_for_cuda(dit, bf16: bool) -> None:
    """The DiT's layers as the CUDA path runs them: with `bf16` their Linear weights in bfloat16
    once (autocast would cast every weight again in each of a chunk's 36 evaluations: 15% of
    the GPU time of 8 streamed windows; the products are the same), then q, k, v joined."""
    if bf16:
        for module in dit.transformer_blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(torch.bfloat16)
    fuse_projections(dit)


def fuse_projections(dit) -> None:
    """Join each layer's q, k, v weights into one [3 x inner, dim] tensor (and the biases), the
    three Linear modules keeping views of it: one GEMM instead of three per layer, with the
    same parameters and state-dict names."""
    for layer in dit.transformer_blocks:
        attn = layer.attn
        projections = (attn.to_q, attn.to_k, attn.to_v)
        weight = torch.cat([p.weight.detach() for p in projections])
        bias = torch.cat([p.bias.detach() for p in projections])
        inner = attn.to_q.out_features
        for i, p in enumerate(projections):
            p.weight = torch.nn.Parameter(weight[i * inner:(i + 1) * inner], requires_grad=False)
            p.bias = torch.nn.Parameter(bias[i * inner:(i + 1) * inner], requires_grad=False)
        setattr(attn, _JOINED_QKV, (weight, bias))


def _torch_window_attention(attn, query, key, value, rope, mask, block_size: int, back: int,
                            ahead: int) -> torch.Tensor:
    """The window attention in torch's ops: [rows, frames, heads * head_dim]."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb, deinterleave_head_dim

    rows, frames, _ = query.shape
    heads = attn.heads
    query, key, value = (t.reshape(rows, frames, heads, -1) for t in (query, key, value))
    head_dim = query.shape[-1]
    # Rotary embedding on the first head only (the checkpoint was trained so), as transformers.
    cos, sin = rope
    query[:, :, :1], key[:, :, :1] = apply_rotary_pos_emb(
        deinterleave_head_dim(query[:, :, :1]), deinterleave_head_dim(key[:, :, :1]), cos, sin, unsqueeze_dim=2)
    blocks = -(-frames // block_size)
    tail = blocks * block_size - frames  # the last block's padding: masked like any padding

    def windows(t: torch.Tensor, before: int, after: int) -> torch.Tensor:
        """[rows * blocks, heads, (before + 1 + after) * block_size, head_dim]: each block's
        window; a strided view of `t` (no copy) for a layer that sees only its own block."""
        if before or after or tail:
            t = F.pad(t, (0, 0, 0, 0, before * block_size, tail + after * block_size))
        blocked = t.view(rows, blocks + before + after, block_size, heads, head_dim)
        if before or after:
            blocked = torch.cat([blocked[:, i:i + blocks] for i in range(before + after + 1)], dim=2)
        return blocked.transpose(2, 3).flatten(0, 1)

    out = F.scaled_dot_product_attention(windows(query, 0, 0), windows(key, back, ahead),
                                         windows(value, back, ahead), attn_mask=mask)
    out = out.view(rows, blocks, heads, block_size, head_dim).transpose(2, 3).reshape(rows, -1, heads * head_dim)
    return out[:, :frames].to(query.dtype)


def _window_mask(lengths: torch.Tensor, frames: int, block_size: int, back: int, ahead: int) -> torch.Tensor:
    """[B * blocks, 1, block_size, (back + 1 + ahead) * block_size] bool: which keys of its
    window each query sees. A real query sees the window's real positions (what
    transformers' block mask allows); a padding query sees the window's padding, never real
    positions, so no real output depends on padding and no softmax row is empty (NaN)."""
    device = lengths.device
    blocks = -(-frames // block_size)
    query_pos = torch.arange(blocks * block_size, device=device).view(blocks, block_size)
    window_blocks = torch.arange(blocks, device=device)[:, None] + torch.arange(-back, ahead + 1, device=device)
    key_pos = (window_blocks[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    exists = (window_blocks >= 0) & (window_blocks < blocks)
    exists = exists[:, :, None].expand(-1, -1, block_size).flatten(1)  # [blocks, window keys]
    limit = lengths[:, None, None]
    key_real = (key_pos < limit) & exists  # [B, blocks, window keys]
    key_padding = (key_pos >= limit) & exists
    query_real = (query_pos < limit)[..., None]  # [B, blocks, block_size, 1]
    mask = torch.where(query_real, key_real[:, :, None], key_padding[:, :, None])
    return mask.flatten(0, 1)[:, None]
