"""The CUDA fast path against the portable torch reference (runs only where CUDA is)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni import LLM, SamplingParams  # noqa: E402
from vllm_omni.model_executor.forward_context import AttentionMetadata  # noqa: E402
from vllm_omni.model_executor.layers.attention import TorchAttentionBackend  # noqa: E402
from vllm_omni.model_executor.layers.triton_attention import TritonAttentionBackend  # noqa: E402

from ..core.test_llm_vs_hf import hf_greedy, make_prompts  # noqa: E402


def build_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).tolist()  # scattered blocks
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables, slots, next_block = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long), [], 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        n = -(-s // block_size)
        tables[i, :n] = torch.tensor(perm[next_block : next_block + n])
        next_block += n
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(s - q, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"), query_start_loc=torch.tensor(qsl, device="cuda"),
        seq_lens=torch.tensor(seq_lens, device="cuda"), block_tables=tables.cuda(), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    q = torch.randn(qsl[-1], num_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k_cache, v_cache, meta


def run(backend, q, k, v, meta, scale):
    meta.backend_state = backend.prepare(meta)
    return backend.forward(q, k, v, meta, scale).float()


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("heads", [(28, 4, 128), (16, 16, 64), (32, 8, 128), (8, 1, 64)])
@pytest.mark.parametrize("seq_lens", [[1], [17, 600, 3000, 40], [4097] * 3, [40000, 65]])
def test_decode_kernel_matches_torch_backend(heads, seq_lens):
    num_heads, num_kv, head_dim = heads
    q, k, v, meta = build_case([1] * len(seq_lens), seq_lens, num_heads, num_kv, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    ref = run(TorchAttentionBackend(), q.float(), k.float(), v.float(), meta, scale)
    got = run(TritonAttentionBackend(torch.bfloat16), q, k, v, meta, scale)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2


def test_decode_grid_bound_above_the_real_lengths():
    # Under CUDA graphs the grid is sized for max_model_len; programs past a sequence's end
    # must contribute nothing.
    from vllm_omni.model_executor.layers.triton_attention import paged_decode_attention

    q, k, v, meta = build_case([1, 1, 1], [5, 300, 1000], 28, 4, 128, torch.bfloat16)
    ref = run(TorchAttentionBackend(), q.float(), k.float(), v.float(), meta, 0.1)
    got = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.1, max_seq_len=32768).float()
    assert rel_err(got, ref) < 1e-2


def test_decode_kernel_float32_is_exact_enough():
    q, k, v, meta = build_case([1, 1], [33, 700], 8, 2, 64, torch.float32)
    ref = run(TorchAttentionBackend(), q, k, v, meta, 0.125)
    got = run(TritonAttentionBackend(torch.float32), q, k, v, meta, 0.125)
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_with_cached_prefix_matches_torch_backend(dtype):
    # Fresh prefill, prefill after a cached prefix, a chunk in the middle, and decodes, mixed.
    query_lens, seq_lens = [37, 20, 1, 64, 1], [37, 100, 515, 300, 9]
    q, k, v, meta = build_case(query_lens, seq_lens, 28, 4, 128, dtype)
    ref = run(TorchAttentionBackend(), q.float(), k.float(), v.float(), meta, 128**-0.5)
    got = run(TritonAttentionBackend(dtype), q, k, v, meta, 128**-0.5)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("engine_args", [{}, {"enforce_eager": True}, {"max_num_batched_tokens": 16}],
                         ids=["cuda_graphs", "eager", "chunked"])
def test_engine_on_cuda_matches_transformers(tiny_model, engine_args):
    path = str(tiny_model("qwen3"))
    prompts = make_prompts(300, [3, 15, 16, 17, 33, 50, 7])
    expected = [hf_greedy(path, p, 12) for p in prompts]  # CPU float32 reference
    llm = LLM(path, device="cuda", dtype="float32", **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bf16_graphs_agree_with_torch_backend(tiny_model, monkeypatch, arch):
    path = str(tiny_model(arch))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(300, [5, 40, 90])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    fast = LLM(path, device="cuda", dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("VLLM_OMNI_ATTENTION_BACKEND", "torch")
    ref = LLM(path, device="cuda", dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, ref):
        # Greedy paths may diverge after a near-tie in bf16; the first tokens' logprobs must agree.
        lp_a, lp_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert a.outputs[0].token_ids[0] == token
        assert abs(lp_a[token] - lp_b[token]) < 5e-2
