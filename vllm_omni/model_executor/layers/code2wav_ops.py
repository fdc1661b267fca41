"""Fused Triton kernels of the code2wav stages (CUDA only): the codec vocoders' SnakeBeta and
residual sums (Qwen3-Omni, Qwen3-TTS), Qwen2.5-Omni BigVGAN's anti-aliased SnakeBeta, and the
Qwen2.5-Omni token2wav DiT's attention, adaptive norms and gated residuals.

Between a vocoder's convolutions and a DiT's products the work is memory-bound or launch-bound:
each of these does in one pass what torch does in several kernels. Callers use them only for
CUDA tensors; the CPU keeps the torch implementations (and the references' bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


# The vocoder kernels run eagerly on every new chunk length (first and last chunks of each
# request): Triton would compile a variant for each new power-of-two block and each new
# divisibility by 16 of a length or stride, ~0.1-0.3 s on the stage's host in the middle of
# serving (GPU round 11: 3-8 s requests under Poisson arrivals, first audio p95 148 ms in clusters
# behind such stalls). So one block size, and the length-derived arguments unspecialized: one
# variant per dtype and bias flag, compiled at the first chunk.
_VOCODER_BLOCK = 1024


@triton.jit(do_not_specialize=["length", "left_pad", "stride_b", "stride_c"])
def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, bias_ptr, out_ptr, channels, length, left_pad, stride_b,
                       stride_c, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b * channels + c
    b, c = row // channels, row % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # output columns: left_pad zeros, then x's
    src = cols - left_pad
    inside = (src >= 0) & (src < length)
    x = tl.load(x_ptr + b * stride_b + c * stride_c + src, mask=inside, other=0.0)
    dt = x.dtype
    if HAS_BIAS:  # the previous conv's bias, added as torch adds it after a cuDNN conv
        x = (x.to(tl.float32) + tl.load(bias_ptr + c).to(tl.float32)).to(dt)
    # The per-channel factors as torch makes them: exp, + 1e-9, reciprocal, each rounded to the dtype.
    alpha = libdevice.exp(tl.load(alpha_ptr + c).to(tl.float32)).to(dt).to(tl.float32)
    beta = (libdevice.exp(tl.load(beta_ptr + c).to(tl.float32)).to(dt).to(tl.float32) + 1e-9).to(dt)
    inv_beta = tl.math.div_rn(1.0, beta.to(tl.float32)).to(dt).to(tl.float32)
    xf = x.to(tl.float32)
    s = libdevice.sin((xf * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    s2 = (s * s).to(dt).to(tl.float32)
    y = tl.where(src >= 0, xf + (inv_beta * s2).to(dt).to(tl.float32), 0.0)  # the padding stays 0
    tl.store(out_ptr + row * (left_pad + length) + cols, y.to(dt), mask=cols < left_pad + length)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, left_pad: int = 0,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """SnakeBeta(x + bias) = y + sin(y * e^alpha)^2 / (e^beta + 1e-9), y = x + bias, in one pass:
    x [B, C, T] (rows may be strided, time contiguous), alpha/beta/bias [C] in x's dtype ->
    [B, C, left_pad + T], contiguous, with left_pad zeros first. Every op rounds to the dtype
    where torch's unfused ops do, and no multiply-add is fused, so the result equals theirs bit
    for bit."""
    batch, channels, length = x.shape
    out = torch.empty(batch, channels, left_pad + length, dtype=x.dtype, device=x.device)
    bias_or_unused = alpha if bias is None else bias  # HAS_BIAS=False never reads it
    _snake_beta_kernel[(batch * channels, triton.cdiv(left_pad + length, _VOCODER_BLOCK))](
        x, alpha, beta, bias_or_unused, out, channels, length, left_pad, x.stride(0), x.stride(1),
        HAS_BIAS=bias is not None, BLOCK=_VOCODER_BLOCK, num_warps=4, enable_fp_fusion=False,
    )
    return out


@triton.jit(do_not_specialize=["length", "sx_b", "sx_c", "sy_b", "sy_c"])
def _bias_residual_add_kernel(x_ptr, y_ptr, bias_ptr, out_ptr, channels, length, sx_b, sx_c, sy_b, sy_c,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b, c = row // channels, row % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < length
    x = tl.load(x_ptr + b * sx_b + c * sx_c + cols, mask=mask, other=0.0)
    y = tl.load(y_ptr + b * sy_b + c * sy_c + cols, mask=mask, other=0.0)
    dt = y.dtype
    y = (y.to(tl.float32) + tl.load(bias_ptr + c).to(tl.float32)).to(dt)  # conv + bias, rounded as torch's
    tl.store(out_ptr + row * length + cols, (x.to(tl.float32) + y.to(tl.float32)).to(dt), mask=mask)


def bias_residual_add(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + (y + bias) in one pass, rounded as torch's two adds: x, y [B, C, T] (rows may be
    strided, time contiguous), bias [C] -> a contiguous [B, C, T]."""
    batch, channels, length = y.shape
    out = torch.empty(batch, channels, length, dtype=y.dtype, device=y.device)
    _bias_residual_add_kernel[(batch * channels, triton.cdiv(length, _VOCODER_BLOCK))](
        x, y, bias, out, channels, length, x.stride(0), x.stride(1), y.stride(0), y.stride(1), BLOCK=_VOCODER_BLOCK,
        num_warps=4, enable_fp_fusion=False,
    )
    return out




@triton.jit
def _dit_head_tile(ptr, pos, pos_stride, frames, cos_ptr, sin_ptr, rotate, D: tl.constexpr):
    """A head's [BLOCK, D] tile at positions `pos`; with `rotate`, after the checkpoint's RoPE
    (transformers' `apply_rotary_pos_emb(deinterleave_head_dim(x))`: pairs (2i, 2i + 1) rotate by
    angle i, the odd one with the table's second half), rounded to the input's dtype and kept
    interleaved, which gives q . k the same terms."""
    c = tl.arange(0, D)
    rows = ptr + pos[:, None] * pos_stride
    inside = (pos < frames)[:, None]
    x = tl.load(rows + c[None, :], mask=inside, other=0.0)
    if rotate:  # even c: x cos - x[c + 1] sin; odd c: x cos + x[c - 1] sin
        odd = c % 2
        partner = tl.load(rows + (c ^ 1)[None, :], mask=inside, other=0.0).to(tl.float32)
        at = pos[:, None] * D + (c // 2 + odd * (D // 2))[None, :]
        cos = tl.load(cos_ptr + at, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=inside, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * cos + tl.where(odd == 1, 1.0, -1.0)[None, :] * partner * sin).to(x.dtype)
    return x


@triton.jit
def _dit_window_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, lengths_ptr, out_ptr, frames, blocks,
                                 block_size, heads, row_stride, pos_stride, scale,
                                 BACK: tl.constexpr, AHEAD: tl.constexpr, BLOCK: tl.constexpr,
                                 D: tl.constexpr, PRECISION: tl.constexpr):
    row_block, head = tl.program_id(0), tl.program_id(1)
    row, block = row_block // blocks, row_block % blocks
    length = tl.load(lengths_ptr + row)
    i = tl.arange(0, BLOCK)
    q_pos = tl.where(i < block_size, block * block_size + i, frames)  # the tile's spare rows: outside
    head_off = row * row_stride + head * D
    rotate = head == 0  # the checkpoint's RoPE is on its first head only
    q = _dit_head_tile(q_ptr + head_off, q_pos, pos_stride, frames, cos_ptr, sin_ptr, rotate, D)
    q_real = (q_pos < length)[:, None]
    d = tl.arange(0, D)
    m = tl.full([BLOCK], -1e30, tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for w in tl.static_range(BACK + 1 + AHEAD):
        key_block = block - BACK + w
        k_pos = tl.where((i < block_size) & (key_block >= 0) & (key_block < blocks), key_block * block_size + i,
                         blocks * block_size)  # past every window: never attended
        k = _dit_head_tile(k_ptr + head_off, k_pos, pos_stride, frames, cos_ptr, sin_ptr, rotate, D)
        # A real query sees the window's real keys, a padding query its padding keys (the last
        # block's tail past `frames` included, zeros like torch's padding), never both.
        seen = (k_pos < blocks * block_size)[None, :] & ((k_pos < length)[None, :] == q_real)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(seen, scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        correction = tl.exp(m - m_new)
        l = l * correction + tl.sum(p, 1)
        v = tl.load(v_ptr + head_off + k_pos[:, None] * pos_stride + d[None, :], mask=(k_pos < frames)[:, None],
                    other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = out_ptr + (row * frames + q_pos[:, None]) * (heads * D) + head * D + d[None, :]
    tl.store(out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=(q_pos < frames)[:, None])


def dit_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         lengths: torch.Tensor, heads: int, block_size: int, back: int, ahead: int) -> torch.Tensor:
    """The Qwen2.5-Omni token2wav DiT's attention in one kernel: RoPE on the first head
    (interleaved pairs, as transformers' `deinterleave_head_dim` + `apply_rotary_pos_emb`), then
    each block of `block_size` query frames against its window of `back` blocks before, itself
    and `ahead` after, real queries against real keys and padding against padding (see
    token2wav_dit._window_mask). q, k, v [rows, frames, heads * head_dim] (frames contiguous in
    heads x dims; the three may be views of one fused projection with equal strides), cos / sin
    [frames, head_dim] (the rotary table in its dtype), lengths [rows] -> [rows, frames, heads * head_dim] in
    q's dtype.
    Float32 inputs are multiplied in IEEE float32 unless TF32 matmuls are on."""
    rows, frames, inner = q.shape
    head_dim = inner // heads
    assert k.stride() == q.stride() == v.stride() and q.stride(2) == 1, "q, k, v: one layout, dims contiguous"
    blocks = triton.cdiv(frames, block_size)
    out = torch.empty(rows, frames, inner, dtype=q.dtype, device=q.device)
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    _dit_window_attention_kernel[(rows * blocks, heads)](
        q, k, v, cos, sin, lengths, out, frames, blocks, block_size, heads, q.stride(0), q.stride(1),
        head_dim ** -0.5, BACK=back, AHEAD=ahead, BLOCK=max(16, triton.next_power_of_2(block_size)),
        D=head_dim, PRECISION="tf32" if tf32 or q.dtype != torch.float32 else "ieee", num_warps=4,
    )
    return out


_ANTI_ALIAS_BLOCK = 256  # outputs per program


@triton.jit
def _upsampled_snake(row_ptr, n, length, up_ptr, alpha, inv_beta, ODD: tl.constexpr):
    """SnakeBeta of sample 2n + ODD of the 2x upsampled row (transformers' UpSample1d: replicate
    padding by 5, a 12-tap transposed filter, times 2): even samples take the filter's odd
    taps against x[n+2] .. x[n-3], odd samples its even taps against x[n+3] .. x[n-2]."""
    acc = 0.0
    for r in tl.static_range(6):
        src = tl.minimum(tl.maximum(n + 2 + ODD - r, 0), length - 1)  # replicate padding
        acc += tl.load(up_ptr + 1 - ODD + 2 * r) * tl.load(row_ptr + src)
    up = 2.0 * acc
    sine = libdevice.sin(up * alpha)
    return up + inv_beta * (sine * sine)


@triton.jit
def _snake_pair_to_scratch(row_ptr, n, length, up_ptr, alpha, inv_beta, first, last, scratch, at,
                           WIDTH: tl.constexpr):
    """Both snake samples of positions n (2n, 2n + 1) into scratch[at] and scratch[WIDTH + at];
    past either end, DownSample1d's replicate padding: s[0] / s[2L-1]."""
    even = _upsampled_snake(row_ptr, n, length, up_ptr, alpha, inv_beta, 0)
    odd = _upsampled_snake(row_ptr, n, length, up_ptr, alpha, inv_beta, 1)
    edge = tl.where(n < 0, first, last)
    outside = (n < 0) | (n >= length)
    tl.store(scratch + at, tl.where(outside, edge, even))
    tl.store(scratch + WIDTH + at, tl.where(outside, edge, odd))


@triton.jit(do_not_specialize=["length", "stride_b", "stride_c"])
def _anti_aliased_snake_kernel(x_ptr, alpha_ptr, beta_ptr, up_ptr, down_ptr, scratch_ptr, out_ptr, channels,
                               length, stride_b, stride_c, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0), tl.program_id(1)  # row: b * channels + c
    b, c = row // channels, row % channels
    row_ptr = x_ptr + b * stride_b + c * stride_c
    alpha = libdevice.exp(tl.load(alpha_ptr + c))
    inv_beta = 1.0 / (libdevice.exp(tl.load(beta_ptr + c)) + 1e-9)
    first = _upsampled_snake(row_ptr, length * 0, length, up_ptr, alpha, inv_beta, 0)  # s[0]
    last = _upsampled_snake(row_ptr, length - 1, length, up_ptr, alpha, inv_beta, 1)  # s[2L-1]
    # Each output t filters s[2t-5] .. s[2t+6]: the tile's outputs [t0, t0 + BLOCK) need the
    # snake pairs of n in [t0 - 3, t0 + BLOCK + 3), computed once each into this program's
    # scratch (WIDTH = BLOCK + 8 of them), then read back shifted.
    t0 = tile * BLOCK
    WIDTH = BLOCK + 8
    scratch = scratch_ptr + (row * tl.num_programs(1) + tile) * 2 * WIDTH
    i = tl.arange(0, BLOCK)
    halo = tl.arange(0, 8)
    _snake_pair_to_scratch(row_ptr, t0 - 3 + i, length, up_ptr, alpha, inv_beta, first, last, scratch, i, WIDTH)
    _snake_pair_to_scratch(row_ptr, t0 - 3 + BLOCK + halo, length, up_ptr, alpha, inv_beta, first, last, scratch,
                           BLOCK + halo, WIDTH)
    tl.debug_barrier()  # the scratch written by every thread of the program, before any reads it
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(12):  # y[t] = sum_j down[j] * s[2t + j - 5]; 2t + j - 5 = 2n + odd
        n_at = i + (j + 1) // 2  # n - (t0 - 3)
        acc += tl.load(down_ptr + j) * tl.load(scratch + ((j + 1) % 2) * WIDTH + n_at)
    t = t0 + i
    tl.store(out_ptr + row * length + t, acc, mask=t < length)


def anti_aliased_snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, up_filter: torch.Tensor,
                            down_filter: torch.Tensor) -> torch.Tensor:
    """transformers' anti-aliased SnakeBeta of BigVGAN (ratio 2, 12-tap filters) in one pass:
    upsample 2x, x + sin(x e^alpha)^2 / (e^beta + 1e-9), low-pass and take every other sample.
    torch runs it as ~10 kernels (two replicate pads, a depthwise transposed conv, five
    elementwise ops, a depthwise conv), each over the 2x signal. x [B, C, T] float32 (rows may
    be strided, time contiguous), alpha/beta [C], filters [12] -> [B, C, T]. Within float32
    rounding of torch's ops (sums in another order)."""
    batch, channels, length = x.shape
    out = torch.empty(batch, channels, length, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(length, _ANTI_ALIAS_BLOCK)
    scratch = torch.empty(batch * channels * tiles * 2 * (_ANTI_ALIAS_BLOCK + 8), dtype=torch.float32,
                          device=x.device)
    _anti_aliased_snake_kernel[(batch * channels, tiles)](
        x, alpha, beta, up_filter, down_filter, scratch, out, channels, length, x.stride(0), x.stride(1),
        BLOCK=_ANTI_ALIAS_BLOCK, num_warps=4,
    )
    return out


@triton.jit
def _store_modulated_norm(x, scale_ptr, shift_ptr, mod, out_ptr, row, cols, mask, n_cols, eps):
    """LayerNorm of the float32 row x, times (1 + scale) plus shift, stored to out_ptr's row."""
    mean = tl.sum(x, 0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    normed = centered * tl.rsqrt(tl.sum(centered * centered, 0) / n_cols + eps)
    scale = tl.load(scale_ptr + mod + cols, mask=mask, other=0.0)
    one_plus = (1.0 + scale.to(tl.float32)).to(scale.dtype).to(tl.float32)  # rounded as torch's `1 + scale`
    shift = tl.load(shift_ptr + mod + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * one_plus + shift).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ada_layer_norm_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, n_cols, frames, stride_mod, eps,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0)  # batch row * frames + frame
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    _store_modulated_norm(x, scale_ptr, shift_ptr, (row // frames) * stride_mod, out_ptr, row, cols, mask, n_cols,
                          eps)


def ada_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift (no affine weights; DiT adaptive norm) in one pass:
    x [B, T, D] contiguous, scale / shift [B, D] (rows may be strided: chunks of one
    projection) -> [B, T, D] in out_dtype, computed in float32 (`1 + scale` rounded to scale's
    dtype, as torch rounds it). Within float32 rounding of torch's ops (the mean and variance are
    summed in another order), then rounded once to out_dtype."""
    batch, frames, dim = x.shape
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _ada_layer_norm_kernel[(batch * frames,)](
        x, scale, shift, out, dim, frames, scale.stride(0), eps,
        BLOCK=triton.next_power_of_2(dim), num_warps=4 if dim <= 4096 else 8, enable_fp_fusion=False,
    )
    return out


@triton.jit
def _gated_residual_norm_kernel(x_ptr, gate_ptr, y_ptr, scale_ptr, shift_ptr, sum_ptr, out_ptr, n_cols, frames,
                                stride_gate, stride_mod, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # batch row * frames + frame
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    at = row * n_cols + cols
    x = tl.load(x_ptr + at, mask=mask, other=0.0)
    gate = tl.load(gate_ptr + (row // frames) * stride_gate + cols, mask=mask, other=0.0)
    y = tl.load(y_ptr + at, mask=mask, other=0.0)
    gated = (gate.to(tl.float32) * y.to(tl.float32)).to(y.dtype)  # torch's `gate * y`, rounded
    total = (x.to(tl.float32) + gated.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + at, total, mask=mask)
    _store_modulated_norm(total.to(tl.float32), scale_ptr, shift_ptr, (row // frames) * stride_mod, out_ptr, row,
                          cols, mask, n_cols, eps)


def gated_residual_norm(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                        shift: torch.Tensor, eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x + gate[:, None] * y, rounded as torch's two ops, and `ada_layer_norm` of that sum in one
    pass (a DiT layer's gated residual and the norm that reads it): x, y [B, T, D] contiguous,
    gate / scale / shift [B, D] (rows may be strided; gate of y's dtype) -> (the sum in
    promote(x, y), its modulated norm in out_dtype)."""
    batch, frames, dim = x.shape
    total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, y.dtype), device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _gated_residual_norm_kernel[(batch * frames,)](
        x, gate, y, scale, shift, total, out, dim, frames, gate.stride(0), scale.stride(0), eps,
        BLOCK=triton.next_power_of_2(dim), num_warps=4 if dim <= 4096 else 8, enable_fp_fusion=False,
    )
    return total, out
