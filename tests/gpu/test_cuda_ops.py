"""Fused CUDA kernels against the torch implementations they replace."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.model_executor.layers import (  # noqa: E402
    activation, code2wav_ops, cuda_ops, layernorm, rotary, sampling_ops)
from vllm_omni.model_executor.layers.attention import store_kv  # noqa: E402
from vllm_omni.model_executor.layers.rotary import get_rope  # noqa: E402
from vllm_omni.model_executor.models.decoder import DecoderAttention  # noqa: E402
from vllm_omni.model_executor.models.predictor_graphs import sample_codes  # noqa: E402
from vllm_omni.model_executor.models.frame_predictor import FrameCacheAttention  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def ulp_close(got, ref, dtype):
    # Within one unit in the last place of the dtype (exp/rsqrt implementations differ).
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 3584), (300, 64), (5, 4, 128)])
def test_rms_norm(dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = (torch.randn(shape[-1], device="cuda") * 0.2 + 1).to(dtype)
    ulp_close(cuda_ops.rms_norm(x, w, 1e-6), layernorm.rms_norm(x, w, 1e-6), dtype)
    if len(shape) == 2:
        r = torch.randn(shape, device="cuda", dtype=dtype)
        out, res = cuda_ops.rms_norm(x, w, 1e-6, r)
        assert torch.equal(res, x + r)
        ulp_close(out, layernorm.rms_norm(x + r, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_view(dtype):
    t, h, d = 9, 28, 128
    qkv = torch.randn(t, (h + 8) * d, device="cuda", dtype=dtype)
    q = qkv[:, : h * d].view(t, h, d)  # strided rows, like the fused QKV output
    rope = rotary.RotaryEmbedding(d, 1e6, 4096).cuda()
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (t,), device="cuda"), dtype)
    ref = q * cos[:, None] + rotary.rotate_half(q) * sin[:, None]
    cuda_ops.rotary_(q, cos, sin)
    ulp_close(q, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(13, 2 * 1000, device="cuda", dtype=dtype)
    ulp_close(cuda_ops.silu_and_mul(x), activation.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm",
                         [(16, 8, 128, True), (8, 2, 64, True), (6, 6, 64, False)])
def test_frame_attention_kernel_matches_the_torch_path(dtype, heads, kv_heads, head_dim, qk_norm):
    """A code predictor layer's fused attention (norms, rotary, cache write, causal attention in
    one kernel) against the same layer's torch ops, over a whole frame: a 2-token prefill, then
    single tokens up to the cache's end."""
    config = SimpleNamespace(hidden_size=192, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = DecoderAttention(config, qkv_bias=False, o_bias=False, qk_norm=qk_norm).to(dtype)
        rope = get_rope(head_dim, {"rope_type": "default", "rope_theta": 1e6}, 17)
    for p in layer.parameters():
        p.data.normal_(1.0 if p.dim() == 1 else 0.0, 0.2 if p.dim() == 1 else 0.08)
    fused, ref = FrameCacheAttention(layer, 17), FrameCacheAttention(layer, 17)
    ref._attend_fused = ref._attend  # the torch ops on the same device
    batch = 3
    fused.reset(batch)
    ref.reset(batch)
    positions = torch.arange(2, device="cuda").repeat(batch)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    with torch.inference_mode():
        for step in range(16):
            x = torch.randn(positions.shape[0], 192, device="cuda", dtype=dtype)
            cos, sin = rope.cos_sin(positions, dtype)
            torch.testing.assert_close(fused(x, cos, sin), ref(x, cos, sin), atol=tol, rtol=tol, msg=f"step {step}")
            positions = torch.full((batch,), step + 2, device="cuda")
        torch.testing.assert_close(fused.k_cache, ref.k_cache, atol=tol, rtol=tol)
        assert torch.equal(fused.v_cache, ref.v_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", [(1, 896, 1536), (2, 4096, 1024), (1, 37, 300), (2, 1000, 4096),
                                        (1, 896, 18944), (2, 300, 5000)])
def test_small_m_linear_matches_float32_matmul(dtype, rows, n, k):
    """Decode-time x @ W^T (+ bias) on strided rows, every program shape (few or many column
    tiles, long rows in chunks), against the float32 product: one rounding to the dtype (float32
    accumulation)."""
    x = torch.randn(rows, 2 * k, device="cuda", dtype=dtype)[:, :k]
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    for bias in (None, b):
        ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = cuda_ops.small_m_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        ulp_close(got, ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k, gated", [(1, 2560, 896, False), (2, 4096, 1024, False), (1, 6144, 1024, True),
                                               (2, 200, 300, True), (1, 37, 1500, False)])
def test_norm_linear_matches_the_separate_kernels(dtype, rows, n, k, gated):
    """The RMSNorm fused into the product after it (and the gated SiLU after a gate/up product)
    against the kernels it replaces, on strided rows, with and without a residual and a bias: the
    residual stream bit for bit, the output within an ulp of the float32 product of the same
    normalized rows (the accumulation order differs); K past one chunk (1500) included."""
    x = torch.randn(rows, 2 * k, device="cuda", dtype=dtype)[:, :k]
    res = torch.randn(rows, k, device="cuda", dtype=dtype)
    norm_w = (1 + 0.2 * torch.randn(k, device="cuda")).to(dtype)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    for residual in (None, res):
        for bias in ((None,) if gated else (None, b)):
            normed = cuda_ops.rms_norm(x, norm_w, 1e-6, residual)
            normed, stream = normed if residual is not None else (normed, None)
            ref = torch.nn.functional.linear(normed.float(), w.float(), None if bias is None else bias.float())
            ref = ref.to(dtype)
            got = cuda_ops.norm_linear(x, norm_w, 1e-6, w, bias, residual, gated)
            if residual is not None:
                got, got_stream = got
                assert torch.equal(got_stream, stream)
            if gated:
                ref = cuda_ops.silu_and_mul(ref)
            assert got.dtype == dtype and got.shape == ref.shape
            ulp_close(got, ref, dtype)


def _decode_chain(x, layers):
    """Decode-path kernels back to back, each reading what the one before wrote (a layer's norms,
    products, rotary and activation at one row), and a residual stream across the layers."""
    residual = x
    for norm_w, w_qkv, w_o, w_gate_up, w_up, w_down, cos, sin in layers:
        qkv, residual = cuda_ops.norm_linear(x, norm_w, 1e-6, w_qkv, None, residual)
        cuda_ops.rotary_(qkv.view(1, -1, 64), cos, sin)
        h, residual = cuda_ops.rms_norm(cuda_ops.small_m_linear(qkv, w_o), norm_w, 1e-6, residual)
        act = cuda_ops.norm_linear(h, norm_w, 1e-6, w_gate_up, gated=True)
        x = cuda_ops.small_m_linear(cuda_ops.silu_and_mul(cuda_ops.small_m_linear(act, w_up)), w_down)
    return x, residual


def test_programmatic_dependent_launch_keeps_every_kernel_after_its_inputs(monkeypatch):
    """Under programmatic dependent launch (Hopper: each kernel may start while the one before it
    runs, and reads its weights before waiting) a chain of dependent decode kernels gives the bits
    it gives with every launch serialized, eagerly and on every one of many CUDA graph replays:
    no kernel reads an input, or writes an output, before the kernels before it are done."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    assert cuda_ops.pdl_launch(torch.device("cuda"))["PDL"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    hidden = 512
    layers = []
    for _ in range(12):
        angles = torch.rand(1, 32, device="cuda", generator=g) * 6
        cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()
        layers.append((1 + rand(hidden, scale=0.1), rand(1024, hidden, scale=hidden**-0.5),
                       rand(hidden, 1024, scale=1024**-0.5), rand(2 * 1024, hidden, scale=hidden**-0.5),
                       rand(12288, 1024, scale=1024**-0.5), rand(hidden, 6144, scale=6144**-0.5), cos, sin))
    inputs = [rand(1, hidden) for _ in range(30)]

    def serialized(x):
        monkeypatch.setattr(cuda_ops, "PDL", False)
        try:
            return _decode_chain(x, layers)
        finally:
            monkeypatch.setattr(cuda_ops, "PDL", True)

    for got, expected in zip(_decode_chain(inputs[0], layers), serialized(inputs[0])):
        assert torch.equal(got, expected)
    static_x = inputs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(static_x, layers)
    # A new input each replay: a kernel that read its input early would see the last replay's.
    for x in inputs[1:]:
        static_x.copy_(x)
        graph.replay()
        for got, expected in zip(out, serialized(x)):
            assert torch.equal(got, expected)


def test_decoder_layers_fuse_their_norms_at_decode_rows(monkeypatch):
    """A Qwen3 code predictor's decoder in bf16 (its layers: frame attention, gated MLP) over a
    frame at one and two rows: with its norms fused into the q/k/v and gate/up products (both in
    every layer, every step) it computes what it computes with them apart, within bf16 noise."""
    from vllm_omni.model_executor.models import decoder
    from vllm_omni.model_executor.models.frame_predictor import frame_decoder

    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=64)
    config.num_code_groups = 8  # a frame of 9 positions
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, attentions = frame_decoder(config)
    model = model.to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(1.0 if p.dim() == 1 else 0.0, 0.2 if p.dim() == 1 else 0.05)
    fused_calls = []
    norm_linear = cuda_ops.norm_linear
    monkeypatch.setattr(cuda_ops, "norm_linear", lambda *a, **kw: fused_calls.append(kw) or norm_linear(*a, **kw))

    fuses_norm = decoder.fuses_norm

    def run_frame(batch: int, fuse: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(decoder, "fuses_norm", fuses_norm if fuse else lambda *args: False)
        for attn in attentions:
            attn.reset(batch)
        gen = torch.Generator(device="cuda").manual_seed(batch)
        outs = []
        with torch.inference_mode():
            for step in range(9):  # a 1-token prefill per sequence, then one token a step
                x = torch.randn(batch, 256, device="cuda", generator=gen).to(torch.bfloat16)
                outs.append(model(None, torch.full((batch,), step, device="cuda"), x)[0])
        return outs

    for batch in (1, 2):
        apart = run_frame(batch, fuse=False)
        assert not fused_calls
        fused = run_frame(batch, fuse=True)
        assert len(fused_calls) == 9 * 3 * 2  # steps x layers x (q/k/v, gate/up)
        fused_calls.clear()
        for step, (got, want) in enumerate(zip(fused, apart, strict=True)):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=f"batch {batch} step {step}")


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.9, 50, 1.0), (1.0, 50, 0.8), (0.7, 0, 0.9), (1.0, 0, 1.0)])
def test_sample_codes_kernel_draws_the_torch_rule(temperature, top_k, top_p):
    """The predictor's in-graph sampling as one kernel gives the codes of its torch ops (CPU) for
    the same noise: float32 logits and bf16-rounded ones (ties at the top-k boundary, kept as the
    Sampler keeps them), strided rows, greedy rows taking the argmax."""
    g = torch.Generator().manual_seed(0)
    for bf16 in (False, True):
        logits = torch.randn(9, 2 * 2048, generator=g)[:, :2048] * 3
        logits = logits.bfloat16() if bf16 else logits
        gumbel = -torch.empty(9, 15, 2048).exponential_(generator=g).log()
        greedy = torch.tensor([i % 4 == 0 for i in range(9)])
        want = sample_codes(logits, greedy, gumbel[:, 3], temperature, top_k, top_p)
        got = sampling_ops.sample_codes(logits.cuda(), greedy.cuda(), gumbel.cuda()[:, 3], temperature, top_k, top_p)
        assert got.tolist() == want.tolist(), bf16


@pytest.mark.parametrize("bf16", [False, True])
def test_top_k_race_draws_what_the_torch_sampler_draws(monkeypatch, bf16):
    """The Sampler's random rows with small top-ks (`sampling_ops.top_k_race`) give the tokens of its
    torch path for the same seeded noise: rows of different temperatures, top-ks and nuclei
    (top_p = 1: top-k alone), float32 logits and bf16-rounded ones (ties at the k-th logit, which
    the rule keeps), penalized logits of the talker's vocabulary."""
    from vllm_omni.model_executor.layers import sampler as sampler_mod
    from vllm_omni.sampling_params import SamplingParams

    calls = []
    kernel = sampling_ops.top_k_race
    monkeypatch.setattr(sampling_ops, "top_k_race", lambda *args: calls.append(1) or kernel(*args))
    g = torch.Generator().manual_seed(1)
    rows = 48
    params = [SamplingParams(temperature=(0.6, 0.9, 1.0, 1.3)[i % 4], top_k=(1, 5, 40, 50, 200)[i % 5],
                             top_p=(0.8, 1.0, 0.95)[i % 3]) for i in range(rows)]
    race_max = sampler_mod.TOP_K_RACE_MAX
    for step in range(4):
        logits = torch.randn(rows, 8448, generator=g) * 2.5
        logits = (logits.bfloat16() if bf16 else logits).float().cuda()
        drawn = {}
        for path, path_max in (("kernel", race_max), ("torch", 0)):
            monkeypatch.setattr(sampler_mod, "TOP_K_RACE_MAX", path_max)
            generators = [torch.Generator("cuda").manual_seed(1000 * step + i) for i in range(rows)]
            drawn[path] = sampler_mod.Sampler._sample_random(logits, params, generators).tolist()
        assert drawn["kernel"] == drawn["torch"], step
    assert len(calls) == 4  # the kernel drew every step's "kernel" tokens, the torch path the others
    # The kernel saw every kind of row: not all draws are the argmax.
    assert drawn["kernel"] != logits.argmax(-1).tolist()


@pytest.mark.parametrize("repetition, frequency_presence", [(True, False), (False, True), (True, True)])
def test_penalize_kernel_gives_the_bits_of_the_torch_penalties(monkeypatch, repetition, frequency_presence):
    """The Sampler's penalties on CUDA (`sampling_ops.penalize`) equal its torch ops on the CPU bit for
    bit: repetition over prompt and output (positive logits divided, others multiplied),
    frequency and presence over the output, rows without a penalty unchanged."""
    from vllm_omni.model_executor.layers.sampler import SamplingBatch, Sampler
    from vllm_omni.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(2)
    rows, vocab = 6, 5000
    params = [SamplingParams(repetition_penalty=(1.0, 1.3, 0.7)[i % 3] if repetition else 1.0,
                             frequency_penalty=0.2 * (i % 2) if frequency_presence else 0.0,
                             presence_penalty=0.1 * (i % 3) if frequency_presence else 0.0) for i in range(rows)]
    batch = SamplingBatch(params=params,
                          prompt_token_ids=[torch.randint(0, vocab, (30,), generator=g).tolist() for _ in range(rows)],
                          output_token_ids=[torch.randint(0, vocab, (200,), generator=g).tolist() for _ in range(rows)],
                          generators=[None] * rows)
    logits = torch.randn(rows, vocab, generator=g) * 3
    want, _ = Sampler()._apply_penalties(logits, batch)
    calls = []
    kernel = sampling_ops.penalize
    monkeypatch.setattr(sampling_ops, "penalize", lambda *args: calls.append(1) or kernel(*args))
    got, _ = Sampler()._apply_penalties(logits.cuda(), batch)
    assert calls == [1]  # the CUDA rows went through the kernel
    assert not torch.equal(want, logits)
    assert torch.equal(got.cpu(), want)


def test_sampler_kernels_compile_nothing_new_for_new_batch_sizes():
    """The Sampler's kernels run outside the graphs at every batch size: a new size (1, a multiple
    of 16, any other) must reuse the compiled variant, not stall a serving step on a compile."""
    def run(batch: int) -> None:
        logits = torch.randn(batch, 3000, device="cuda")
        counts = torch.randint(0, 2, (batch, 3000), device="cuda", dtype=torch.int32)
        seen = torch.zeros(batch, 3000, device="cuda", dtype=torch.bool)
        factors = torch.ones(3, batch, device="cuda")
        sampling_ops.penalize(logits, counts, seen, factors, True, True)
        rows = torch.ones(batch, device="cuda")
        for max_top_k in (40, 50):  # the same padded width, other fetched counts
            sampling_ops.top_k_race(logits, rows, rows * 5, rows, torch.rand(batch, 3000, device="cuda"), max_top_k)

    run(3)
    before = _compiled_variants(sampling_ops._penalize_kernel), _compiled_variants(sampling_ops._top_k_race_kernel)
    for batch in (1, 2, 16, 17, 64):
        run(batch)
    torch.cuda.synchronize()
    after = _compiled_variants(sampling_ops._penalize_kernel), _compiled_variants(sampling_ops._top_k_race_kernel)
    assert after == before


def test_store_kv_writes_the_right_slots():
    k_cache = torch.zeros(10, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(5, 2, 4 * 64, device="cuda", dtype=torch.bfloat16)
    k, v = kv[:, 0].view(5, 4, 64), kv[:, 1].view(5, 4, 64)
    slots = torch.tensor([3, 17, 159, 40, 0], device="cuda")
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 4, 64)[slots], k)
    assert torch.equal(v_cache.view(-1, 4, 64)[slots], v)
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 5


def _snake_module(channels: int, dtype, fused: bool) -> activation.SnakeBeta:
    torch.manual_seed(0)
    snake = activation.SnakeBeta(channels).cuda()
    with torch.no_grad():  # trained vocoders' alphas and betas lie around +-2 in log scale
        snake.alpha.copy_(torch.randn(channels) * 1.5)
        snake.beta.copy_(torch.randn(channels) * 1.5)
    snake.fused = fused
    return snake.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_snake_beta_equals_torch_bit_for_bit(dtype):
    fused, eager = _snake_module(96, dtype, True), _snake_module(96, dtype, False)
    wide = torch.randn(3, 96, 5000, device="cuda", dtype=dtype) * 4
    bias = torch.randn(96, device="cuda", dtype=dtype)
    for x in (wide, wide[..., 7:4321]):  # contiguous, and strided rows (a transposed conv's trim)
        for left_pad in (0, 54):  # none, and a dilation-9 kernel-7 causal conv's
            for b in (None, bias):  # a conv's bias added first
                got = fused(x, left_pad, b)
                assert got.is_contiguous() and torch.equal(got, eager(x, left_pad, b))
                assert not got[..., :left_pad].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_residual_add_equals_torch_bit_for_bit(dtype):
    wide = torch.randn(3, 96, 5000, device="cuda", dtype=dtype)
    y = torch.randn(3, 96, 4000, device="cuda", dtype=dtype)
    bias = torch.randn(96, device="cuda", dtype=dtype)
    for x in (wide[..., :4000], wide[..., 1000:].contiguous()):
        got = code2wav_ops.bias_residual_add(x, y, bias)
        assert got.is_contiguous() and torch.equal(got, x + (y + bias[:, None]))


@pytest.mark.parametrize("autocast", [False, True])
def test_dit_modulated_norms_and_gated_residual_match_torch(autocast):
    """The token2wav DiT's fused norm + modulation, alone and after a gated residual in the same
    kernel, against its torch ops, float32 and under bfloat16 autocast (the `bfloat16` precision:
    modulations from the autocast projection in bfloat16, and the norm written in bfloat16, as the
    next product would cast torch's float32), with scale / shift / gate as strided chunks and as
    one row broadcast to all (the time conditioning)."""
    from vllm_omni.model_executor.models.qwen2_5_omni import token2wav_dit

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 77, 1024, device="cuda", generator=gen)
    y = torch.randn(3, 77, 1024, device="cuda", generator=gen)
    norm = torch.nn.LayerNorm(1024, elementwise_affine=False, eps=1e-6)
    for modulation in (torch.randn(3, 6 * 1024, device="cuda", generator=gen) * 0.3,
                       (torch.randn(1, 6 * 1024, device="cuda", generator=gen) * 0.3).expand(3, -1)):
        if autocast:
            modulation, y = modulation.bfloat16(), y.bfloat16()
        shift, scale, gate = modulation.chunk(6, dim=1)[:3]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            got_norm = token2wav_dit._modulated_norm(norm, x, scale, shift)
            got_sum, got_sum_norm = token2wav_dit._residual_and_norm(x, gate, y, norm, scale, shift)
            ref_norm = norm(x) * (1 + scale[:, None]) + shift[:, None]
            ref_sum = x + gate.unsqueeze(1) * y
            ref_sum_norm = norm(ref_sum) * (1 + scale[:, None]) + shift[:, None]
        assert torch.equal(got_sum, ref_sum)
        for got, ref in ((got_norm, ref_norm), (got_sum_norm, ref_sum_norm)):
            if autocast:
                ref = ref.bfloat16()
            assert got.dtype == ref.dtype
            torch.testing.assert_close(got.float(), ref.float(), atol=2e-5, rtol=8e-3 if autocast else 1e-5)


def _compiled_variants(kernel) -> int:
    """Variants Triton has compiled of `kernel` on this GPU (its per-device kernel cache)."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def test_new_chunk_lengths_compile_no_new_kernel_variant():
    """First and last chunks bring lengths never seen before while the stage serves: they must
    reuse the compiled kernels (a compile stalls the stage for ~0.1-0.3 s), and stay exact."""
    dtype = torch.bfloat16
    fused, eager = _snake_module(32, dtype, True), _snake_module(32, dtype, False)
    bias = torch.randn(32, device="cuda", dtype=dtype)

    def run(length: int) -> None:
        wide = torch.randn(2, 32, length + 9, device="cuda", dtype=dtype) * 4
        for x in (wide[..., :length], wide[..., 9:]):  # odd row strides, unaligned starts
            for left_pad in (0, 6):
                assert torch.equal(fused(x, left_pad, bias), eager(x, left_pad, bias))
            y = torch.randn(2, 32, length, device="cuda", dtype=dtype)
            assert torch.equal(code2wav_ops.bias_residual_add(x, y, bias), x + (y + bias[:, None]))

    run(48)
    before = _compiled_variants(code2wav_ops._snake_beta_kernel), _compiled_variants(code2wav_ops._bias_residual_add_kernel)
    for length in (1, 4, 16, 37, 100, 255, 256, 1000, 3001, 5760):
        run(length)
    after = _compiled_variants(code2wav_ops._snake_beta_kernel), _compiled_variants(code2wav_ops._bias_residual_add_kernel)
    assert after == before


def test_snake_beta_equals_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

    ours = _snake_module(64, torch.float32, True)
    theirs = Qwen3OmniMoeSnakeBeta(64).cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 64, 3000, device="cuda") * 4
    assert torch.equal(ours(x), theirs(x))


def test_anti_aliased_snake_beta_matches_transformers():
    """Qwen2.5-Omni BigVGAN's anti-aliased SnakeBeta (upsample, snake, low-pass) in one kernel
    against transformers' module in float32 (TF32 off): row lengths from 1 (every output at a
    replicated edge) to several tiles, strided rows; new lengths compile no new variant."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAntiAliasedActivation1d, Qwen2_5OmniSnakeBeta,
    )

    torch.manual_seed(0)
    act = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(24)).cuda()
    with torch.no_grad():
        act.act.alpha.normal_(0, 0.5)
        act.act.beta.normal_(0, 0.5)
    kernel = code2wav_ops._anti_aliased_snake_kernel
    for i, length in enumerate((1, 4, 2, 7, 255, 256, 1000, 5761)):  # rows start unaligned, then aligned
        wide = torch.randn(3, 25, length, device="cuda") * 3
        x = wide[:, 1:]  # rows strided
        with torch.no_grad():
            got = code2wav_ops.anti_aliased_snake_beta(x, act.act.alpha, act.act.beta, act.upsample.filter.view(-1),
                                                   act.downsample.filter.view(-1))
            torch.backends.cudnn.allow_tf32 = False
            try:
                ref = act(x)
            finally:
                torch.backends.cudnn.allow_tf32 = True
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        if i == 1:  # both pointer alignments compiled
            variants = _compiled_variants(kernel)
    assert _compiled_variants(kernel) == variants


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dit_window_attention_matches_the_torch_path(dtype):
    """The token2wav DiT's attention kernel (first-head RoPE, block windows, padding kept apart)
    against its torch ops at the released shapes (16 heads of 64, 24-frame blocks), rows of
    different lengths, q / k / v as views of one joined projection."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniDiTConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniDiTRotaryEmbedding

    from vllm_omni.model_executor.models.qwen2_5_omni import token2wav_dit

    rows, frames, heads, head_dim, block = 4, 200, 16, 64, 24
    lengths = torch.tensor([200, 131, 24, 1], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(rows, frames, 3 * heads * head_dim, device="cuda", generator=gen).to(dtype)
    rope = Qwen2_5OmniDiTRotaryEmbedding(Qwen2_5OmniDiTConfig(head_dim=head_dim)).cuda()(
        qkv, torch.arange(frames, device="cuda")[None].repeat(rows, 1))
    attn = SimpleNamespace(heads=heads)
    real = (torch.arange(frames, device="cuda")[None] < lengths[:, None])[..., None]
    for back, ahead in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        got = code2wav_ops.dit_window_attention(*qkv.chunk(3, dim=-1), rope[0][0], rope[1][0], lengths, heads, block,
                                            back, ahead)
        mask = token2wav_dit._window_mask(lengths, frames, block, back, ahead)
        ref = token2wav_dit._torch_window_attention(attn, *qkv.clone().chunk(3, dim=-1), rope, mask, block, back,
                                                    ahead)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(torch.where(real, got, 0).float(), torch.where(real, ref, 0).float(),
                                   atol=tol, rtol=tol)
