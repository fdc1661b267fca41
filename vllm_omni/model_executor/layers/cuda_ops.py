"""Fused Triton kernels for the small ops of a decoder layer (CUDA only).

At batch 1 a decode step is a few large matrix-vector products plus dozens of tiny
element-wise kernels; unfused, each RMSNorm is ~6 kernels and each rotary ~16. These
kernels do each op in one launch and round to the model dtype at the same points as the
torch reference (HF's numerics), so results match within one bf16 ulp.
Layers call them only for CUDA tensors; CPU keeps the torch implementations.

Programmatic dependent launch (Hopper and later): a decode step is hundreds of such launches
back to back, each costing a few microseconds of launch, ramp-up and tail beyond its work. The
decode-path kernels here are launched with `pdl_launch(device)`: the GPU may start a kernel while
the one before it still runs; it reads nothing the earlier kernels write, and writes nothing,
before `wait_for_previous_kernel` (which also lets the next kernel start). What it may do before
that wait is load its weights, which nothing in the step writes: the `weight` of
`small_m_linear` and `norm_linear` must be a parameter, never the output of a kernel just before.
`VLLM_OMNI_PDL=0` turns it off (A/B runs).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda's grid dependency control)

import vllm_omni.envs as envs

PDL = envs.PDL.get()


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The `PDL` argument and launch option of a kernel that calls `wait_for_previous_kernel`."""
    if PDL and device.type == "cuda" and _has_pdl(device.index if device.index is not None else
                                                  torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernels before this one have finished
    (their writes visible), then let the next kernel start launching. Without it: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x0, stride_x1, stride_r0, stride_r1, n_inner,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    outer, inner = row // n_inner, row % n_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + outer * stride_x0 + inner * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_r0 + inner * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds like torch's
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # cast back before the weight multiply (HF order)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [N, D] or [N, H, D] (rows may be strided views). Returns norm(x) or, with residual,
    (norm(x + residual), x + residual); outputs are contiguous."""
    d = x.shape[-1]
    rows3 = x.view(x.shape[0], -1, d) if x.dim() == 3 else x.view(x.shape[0], 1, d)
    n_outer, n_inner = rows3.shape[0], rows3.shape[1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype) if x.dtype != weight.dtype
                      else x.dtype, device=x.device)
    res3 = residual.view(n_outer, n_inner, d) if residual is not None else rows3
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    _rms_norm_kernel[(n_outer * n_inner,)](
        rows3, res3, weight, out, res_out, d, eps,
        rows3.stride(0), rows3.stride(1), res3.stride(0), res3.stride(1), n_inner,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 4096 else 8,
        **pdl_launch(x.device),
    )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, num_heads,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < num_heads
    cos1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)
    base = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch does.
    o1 = ((x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    tl.store(base, o1, mask=mask)
    tl.store(base + HALF, o2, mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x [T, H, D] (head dim contiguous), cos/sin [T, D] in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    _rotary_kernel[(num_tokens,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), num_heads,
        HALF=head_dim // 2, HEADS_PAD=triton.next_power_of_2(num_heads), num_warps=4, **pdl_launch(x.device),
    )
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounds to the dtype, then the product does
    tl.store(out_ptr + row * n_cols + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    num_tokens, width = x.shape
    n = width // 2
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](x, out, n, x.stride(0), BLOCK=block, num_warps=4,
                                                                   **pdl_launch(x.device))
    return out


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v, width,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    tl.store(k_cache_ptr + slot * width + cols, tl.load(k_ptr + t * stride_k + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * width + cols, tl.load(v_ptr + t * stride_v + cols, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v: [T, Hkv, D] (rows may be strided), caches [blocks, block_size, Hkv, D] contiguous."""
    num_tokens = k.shape[0]
    width = k_cache.shape[2] * k_cache.shape[3]
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), width,
                                    BLOCK=triton.next_power_of_2(width), num_warps=4, **pdl_launch(k.device))


@triton.jit
def _rotate_tile(ptr, cos1, cos2, sin1, sin2, h, d, mask, HALF: tl.constexpr):
    """Load a [heads, D] tile at ptr + h + d, return its two rotated halves (HF rounding)."""
    x1 = tl.load(ptr + h + d, mask=mask, other=0.0)
    x2 = tl.load(ptr + h + HALF + d, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                            stride_q, stride_k, stride_v, stride_c, num_heads, num_kv_heads,
                            HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                            PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    d = tl.arange(0, HALF)[None, :]
    cos1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)
    # q: rotated in place.
    hq = tl.arange(0, HEADS_PAD)[:, None]
    mq = hq < num_heads
    q_base = q_ptr + t * stride_q
    o1, o2 = _rotate_tile(q_base, cos1, cos2, sin1, sin2, hq * 2 * HALF, d, mq, HALF)
    tl.store(q_base + hq * 2 * HALF + d, o1, mask=mq)
    tl.store(q_base + hq * 2 * HALF + HALF + d, o2, mask=mq)
    # k: rotated straight into the cache slot; v: copied there.
    hk = tl.arange(0, KV_HEADS_PAD)[:, None]
    mk = hk < num_kv_heads
    slot = tl.load(slots_ptr + t)
    cache_off = slot * num_kv_heads * 2 * HALF + hk * 2 * HALF + d
    k1, k2 = _rotate_tile(k_ptr + t * stride_k, cos1, cos2, sin1, sin2, hk * 2 * HALF, d, mk, HALF)
    tl.store(k_cache_ptr + cache_off, k1, mask=mk)
    tl.store(k_cache_ptr + cache_off + HALF, k2, mask=mk)
    v_base = v_ptr + t * stride_v + hk * 2 * HALF + d
    tl.store(v_cache_ptr + cache_off, tl.load(v_base, mask=mk), mask=mk)
    tl.store(v_cache_ptr + cache_off + HALF, tl.load(v_base + HALF, mask=mk), mask=mk)


def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots) -> None:
    """One launch per layer: rotate q in place, write rotated k and v into their cache slots.

    q: [T, H, D], k/v: [T, Hkv, D] (rows may be strided, heads contiguous), cos/sin [T, D],
    caches [blocks, block_size, Hkv, D] contiguous. The cache then holds exactly what
    `store_kv(rotary(k), v)` would write.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slots, q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        num_heads, num_kv_heads, HALF=head_dim // 2, HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4, **pdl_launch(q.device),
    )


@triton.jit
def _head_norm_rotary(ptr, w1, w2, cos1, cos2, sin1, sin2, d, mask, eps, head_dim, HAS_NORM: tl.constexpr):
    """One head's vector at ptr (its two halves), RMS-normed over the head (Qwen3's q/k norm,
    `rms_norm`'s rounding) and rotated (`_rotate_tile`'s rounding): float32 halves in the dtype's values."""
    x1 = tl.load(ptr + d, mask=mask, other=0.0)
    x2 = tl.load(ptr + head_dim // 2 + d, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / head_dim + eps)
        x1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = ((x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _halves(ptr, half, d, mask):
    """The two halves [0, half) and [half, 2 half) of a head-sized vector at ptr, in float32."""
    return (tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32),
            tl.load(ptr + half + d, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _frame_attention_kernel(q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                            out_ptr, start, stride_q, stride_k, stride_v, stride_c, eps, scale,
                            head_dim, cache_len, num_heads, num_kv_heads,
                            TOKENS: tl.constexpr, GROUP: tl.constexpr, HAS_NORM: tl.constexpr,
                            HALF: tl.constexpr, CACHE_PAD: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # one query head a program: no head waits on another's softmax
    g = h // GROUP
    d = tl.arange(0, HALF)
    dmask = d < head_dim // 2
    half = head_dim // 2
    # Without norms the weights are loaded and never used (the kernel is then rotary only).
    q_w1, q_w2 = _halves(q_w_ptr, half, d, dmask)
    k_w1, k_w2 = _halves(k_w_ptr, half, d, dmask)
    wait_for_previous_kernel(PDL)
    # The earlier calls' keys and values of the sequence, from the cache...
    cache_row = (b * num_kv_heads + g) * cache_len
    s = tl.arange(0, CACHE_PAD)
    kv_off = (cache_row + s[:, None]) * head_dim + d[None, :]
    kv_mask = (s < start)[:, None] & dmask[None, :]
    kc1 = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    kc2 = tl.load(k_cache_ptr + kv_off + half, mask=kv_mask, other=0.0).to(tl.float32)
    vc1 = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    vc2 = tl.load(v_cache_ptr + kv_off + half, mask=kv_mask, other=0.0).to(tl.float32)
    # ...then token by token: its key (normed, rotated) and value at position start + i, kept in
    # registers (the group's first head also writes them to the cache for the next calls), and this
    # head's query attending causally over positions 0..start + i, which are all in by then.
    for i in tl.static_range(TOKENS):
        row = b * TOKENS + i
        cos1, cos2 = _halves(cos_ptr + row * stride_c, half, d, dmask)
        sin1, sin2 = _halves(sin_ptr + row * stride_c, half, d, dmask)
        k1, k2 = _head_norm_rotary(k_ptr + row * stride_k + g * head_dim, k_w1, k_w2, cos1, cos2, sin1, sin2,
                                   d, dmask, eps, head_dim, HAS_NORM)
        v1, v2 = _halves(v_ptr + row * stride_v + g * head_dim, half, d, dmask)
        if h % GROUP == 0:
            slot = (cache_row + start + i) * head_dim
            tl.store(k_cache_ptr + slot + d, k1, mask=dmask)
            tl.store(k_cache_ptr + slot + half + d, k2, mask=dmask)
            tl.store(v_cache_ptr + slot + d, v1.to(k1.dtype), mask=dmask)
            tl.store(v_cache_ptr + slot + half + d, v2.to(k1.dtype), mask=dmask)
        new = (s == start + i)[:, None]
        kc1 = tl.where(new, k1.to(tl.float32)[None, :], kc1)
        kc2 = tl.where(new, k2.to(tl.float32)[None, :], kc2)
        vc1 = tl.where(new, v1[None, :], vc1)
        vc2 = tl.where(new, v2[None, :], vc2)
        q1, q2 = _head_norm_rotary(q_ptr + row * stride_q + h * head_dim, q_w1, q_w2, cos1, cos2, sin1, sin2,
                                   d, dmask, eps, head_dim, HAS_NORM)
        dt = q1.dtype
        scores = tl.sum(q1.to(tl.float32)[None, :] * kc1 + q2.to(tl.float32)[None, :] * kc2, 1) * scale
        scores = tl.where(s <= start + i, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, 0))
        p = p / tl.sum(p, 0)
        out = out_ptr + row * num_heads * head_dim + h * head_dim
        tl.store(out + d, tl.sum(p[:, None] * vc1, 0).to(dt), mask=dmask)
        tl.store(out + half + d, tl.sum(p[:, None] * vc2, 0).to(dt), mask=dmask)


def frame_attention(q, k, v, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, start: int, scale: float):
    """A code predictor layer's attention in one launch: each sequence's T = q.shape[0] / B new
    tokens (positions start..start+T-1) attend causally to its dense cache.

    q [B*T, H*D], k/v [B*T, Hkv*D] (sequence-major rows, which may be strided views of the
    fused QKV output); q_norm/k_norm [D] per-head RMSNorm weights or None; cos/sin [B*T, D] in
    q's dtype; caches [B, Hkv, S, D] contiguous, written at start..start+T-1. Returns [B*T, H*D].
    The norms and the rotary round as `rms_norm` and `rotary_` do; scores and softmax in float32.
    """
    batch, num_kv_heads, cache_len, head_dim = k_cache.shape
    tokens = q.shape[0] // batch
    num_heads = q.shape[1] // head_dim
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    _frame_attention_kernel[(batch, num_heads)](
        q, k, v, q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, k_cache, v_cache, out,
        start, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), eps, scale, head_dim, cache_len,
        num_heads, num_kv_heads, TOKENS=tokens, GROUP=num_heads // num_kv_heads, HAS_NORM=has_norm,
        HALF=triton.next_power_of_2(head_dim // 2), CACHE_PAD=triton.next_power_of_2(cache_len), num_warps=4,
        **pdl_launch(q.device),
    )
    return out


# `small_m_linear` streams rows longer than this in chunks of 2048 columns, 4 columns a program.
LONG_ROW_K = 4096


@triton.jit
def _weight_chunk(w_ptr, row0, k0, n, k, n_mask, k_dim):
    """Rows row0 + n, columns k0 + k of a [N, K] weight (zeros outside)."""
    kk = k0 + k
    return tl.load(w_ptr + (row0 + n)[:, None] * k_dim + kk[None, :], mask=n_mask[:, None] & (kk < k_dim)[None, :],
                   other=0.0)


@triton.jit
def _small_m_chunk(acc, w, x_ptr, k0, m, k, m_mask, k_dim, stride_x):
    """acc [M, N, K chunk] += the rows' chunk at k0 times the weight chunk w, lane by lane."""
    kk = k0 + k
    x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & (kk < k_dim)[None, :], other=0.0)
    return acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _small_m_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, m_rows, n_cols, k_dim, stride_x, stride_out,
                           HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, LONG_ROWS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    k = tl.arange(0, BLOCK_K)
    n_mask, m_mask = n < n_cols, m < m_rows
    # The first chunk of the weight is read before waiting for the kernel that writes x.
    w = _weight_chunk(w_ptr, 0, 0, n, k, n_mask, k_dim)
    wait_for_previous_kernel(PDL)
    acc = _small_m_chunk(tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32), w, x_ptr, 0, m, k, m_mask, k_dim, stride_x)
    if LONG_ROWS:  # many chunks a row: three in flight (without, the loop measured 20% slower)
        for k0 in tl.range(BLOCK_K, k_dim, BLOCK_K, num_stages=3):
            w = _weight_chunk(w_ptr, 0, k0, n, k, n_mask, k_dim)
            acc = _small_m_chunk(acc, w, x_ptr, k0, m, k, m_mask, k_dim, stride_x)
    else:
        for k0 in tl.range(BLOCK_K, k_dim, BLOCK_K):
            w = _weight_chunk(w_ptr, 0, k0, n, k, n_mask, k_dim)
            acc = _small_m_chunk(acc, w, x_ptr, k0, m, k, m_mask, k_dim, stride_x)
    out = tl.sum(acc, 2)
    if HAS_BIAS:
        out += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_out + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (a few rows, which may be strided) @ weight [N, K].T (+ bias) -> [M, N].

    Each program owns a few output columns and walks K with float32 products summed per lane,
    reduced once at the end (float32 accumulation, rounded once to the output dtype): many
    programs, each a short contiguous stream of the weight. `linear` in layers/linear.py says
    where it beats cuBLAS. Few column tiles (a short N) get wider programs: more of the weight
    in flight each. Long rows (a down product's K of 18944) keep 4 columns a program, so a short
    N still fills the GPU, and stream them in 2048-column chunks, three in flight: the fastest of
    the shapes swept on the H200 for the Qwen2.5 talker's 34 MB down product (11.0 us at one row,
    cuBLAS 13.5; `benchmarks/bench_small_linear.py`).
    """
    m_rows, k_dim = x.shape
    n_cols = weight.shape[0]
    m_pad = triton.next_power_of_2(m_rows)
    if k_dim > LONG_ROW_K:
        block_n, block_k, num_warps = 4, 2048, 4
    else:
        # Under 256 programs at the narrow tile (8 columns per row) the GPU is underfilled: wide tiles.
        wide = triton.cdiv(n_cols * m_pad, 8) < 256
        tile, block_k, num_warps = (8192, 1024, 8) if wide else (4096, 512, 4)
        block_k = min(block_k, triton.next_power_of_2(k_dim))
        block_n = max(1, tile // (m_pad * block_k))
    out = torch.empty(m_rows, n_cols, dtype=x.dtype, device=x.device)
    _small_m_linear_kernel[(triton.cdiv(n_cols, block_n),)](
        x, weight, bias if bias is not None else weight, out, m_rows, n_cols, k_dim, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, LONG_ROWS=k_dim > LONG_ROW_K,
        num_warps=num_warps, **pdl_launch(x.device),
    )
    return out


@triton.jit
def _norm_linear_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, m_rows, n_out, k_dim, eps,
                        stride_x, stride_res, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GATED: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, M_PAD)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < m_rows
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    # The weight's first chunk (its whole rows for every product `linear.fuses_norm` admits) is read
    # before waiting for the kernel that writes x.
    w = _weight_chunk(w_ptr, 0, 0, n, k, n_mask, k_dim)
    w_up = _weight_chunk(w_ptr, n_out, 0, n, k, n_mask, k_dim) if GATED else w
    wait_for_previous_kernel(PDL)
    # Pass 1: each row's mean square over K (program 0 also writes the residual stream x + res).
    squares = tl.zeros([M_PAD, BLOCK_K], tl.float32)
    for k0 in tl.range(0, k_dim, BLOCK_K):
        kk = k0 + k
        mk = m_mask[:, None] & (kk < k_dim)[None, :]
        h = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=mk, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + m[:, None] * stride_res + kk[None, :], mask=mk, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # the add rounds like torch's
            if pid == 0:
                tl.store(res_out_ptr + m[:, None] * k_dim + kk[None, :], h, mask=mk)
        hf = h.to(tl.float32)
        squares += hf * hf
    inv_rms = tl.rsqrt(tl.sum(squares, 1) / k_dim + eps)[:, None]
    # Pass 2: the normalized rows (rounded where RMSNorm rounds) against this program's weight rows.
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in tl.range(0, k_dim, BLOCK_K):
        if k0 > 0:
            w = _weight_chunk(w_ptr, 0, k0, n, k, n_mask, k_dim)
            w_up = _weight_chunk(w_ptr, n_out, k0, n, k, n_mask, k_dim) if GATED else w
        kk = k0 + k
        k_mask = kk < k_dim
        mk = m_mask[:, None] & k_mask[None, :]
        h = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=mk, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + m[:, None] * stride_res + kk[None, :], mask=mk, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        y = (h.to(tl.float32) * inv_rms).to(h.dtype)  # HF: normalized, cast back, then the weight
        nw = tl.load(norm_w_ptr + kk, mask=k_mask, other=0.0)
        y = (nw.to(tl.float32)[None, :] * y.to(tl.float32)).to(h.dtype).to(tl.float32)
        acc += tl.sum(y[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        if GATED:
            acc_up += tl.sum(y[:, None, :] * w_up.to(tl.float32)[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if GATED:  # silu(gate) * up with the roundings of the product's output and of silu_and_mul
        g = out.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype)
        out = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + m[:, None] * n_out + n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, gated: bool = False,
                block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None):
    """RMSNorm (after the residual add) fused into the product that reads it, for a few decode rows:
    `linear(rms_norm(x [+ residual]), weight, bias)`, and with `gated` the gated SiLU after it
    (weight = [gate | up] -> silu(gate) * up). Returns the output, and with `residual` also
    x + residual (the residual stream, as `rms_norm` returns it). Each program normalizes the
    rows itself (they are a few KB, read from L2) and streams its rows of the weight, so the
    norm's and the activation's own launches, and their round trips through memory, are gone.
    Numerics: RMSNorm's, silu_and_mul's and the product's roundings, float32 accumulation."""
    m_rows, k_dim = x.shape
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    m_pad = triton.next_power_of_2(m_rows)
    # The fastest program shape for every product `linear.fuses_norm` admits (1-2 rows, K <= 1024:
    # the whole row in one chunk), bench_norm_linear.py --sweep on the H200.
    block_k = block_k or min(1024, triton.next_power_of_2(k_dim))
    block_n = block_n or 4
    out = torch.empty(m_rows, n_out, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    _norm_linear_kernel[(triton.cdiv(n_out, block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else weight,
        out, res_out, m_rows, n_out, k_dim, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, GATED=gated, M_PAD=m_pad,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps or 4, **pdl_launch(x.device),
    )
    return out if residual is None else (out, res_out)
