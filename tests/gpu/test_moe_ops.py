"""The mixture-of-experts layer's kernels (`moe_ops`, and `moe`'s grouped GEMMs) against torch's
router and the float32 reference expert loop."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.model_executor.layers import moe, moe_ops  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_grouped_moe_matches_reference_loop(tokens):
    if not moe.grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    experts, hidden, inter, k = 16, 256, 128, 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.05
    weights, ids = moe.select_experts(torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16), k, True)
    ref = moe.moe_forward_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = moe.moe_forward_grouped(x, w13, w2, weights, ids).float()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("tokens, experts, k, renormalize", [(1, 128, 6, True), (3, 128, 8, True), (2, 60, 1, False),
                                                             (300, 128, 8, True)])
def test_route_kernel_picks_the_experts_of_the_torch_router(tokens, experts, k, renormalize):
    """`moe_ops.route` (softmax, top-k, renormalization in one launch) against `select_experts`'
    torch ops on the same bf16 logits: the experts of the k largest probabilities in descending
    order (bf16 logits tie often; between equal ones either expert is right), k distinct experts
    a token, weights within an ulp of the dtype."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, experts, device="cuda", generator=g).bfloat16()
    weights, ids = moe_ops.route(logits, k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_weights, _ = torch.topk(probs, k, dim=-1)
    assert torch.equal(probs.gather(1, ids), want_weights)
    assert all(len(set(row)) == k for row in ids.tolist())
    if renormalize:
        want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    # within an ulp of bf16 (exp implementations differ)
    torch.testing.assert_close(weights.float(), want_weights.bfloat16().float(), atol=1e-2, rtol=1e-2)
    got_weights, got_ids = moe.select_experts(logits, k, renormalize)  # the layer's router takes the kernel
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("hidden, inter, k", [(1024, 384, 6), (2048, 768, 8), (200, 96, 3)])
def test_few_token_experts_match_the_reference_loop(tokens, hidden, inter, k):
    """The few-token expert kernels (each routed expert's gate/up with its SiLU, then the down
    products summed over the token's slots) against the float32 reference loop on the same bf16
    weights, within the grouped path's tolerance; the experts layer takes them at decode rows."""
    x, w13, w2, weights, ids, ref = _expert_case(tokens, hidden, inter, k)
    got = moe_ops.few_token_experts(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    if moe.takes_few_token_experts(w2, ids):  # the experts layer takes them
        assert torch.equal(_experts_layer(w13, w2)(x, weights, ids), got)


@pytest.mark.parametrize("tokens", [8, 33, 64, 100, 300])
@pytest.mark.parametrize("hidden, inter, k", [(1024, 384, 6), (2048, 768, 8), (200, 96, 3)])
def test_sorted_experts_match_the_reference_loop(tokens, hidden, inter, k):
    """The expert-sorted kernels (each expert's weight tile read once for all its pairs) against
    the float32 reference loop on the same bf16 weights, within the grouped path's tolerance."""
    x, w13, w2, weights, ids, ref = _expert_case(tokens, hidden, inter, k)
    got = moe_ops.sorted_experts(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    if not moe.takes_few_token_experts(w2, ids) and tokens <= moe.SORTED_TOKEN_MAX:  # the layer takes them
        assert torch.equal(_experts_layer(w13, w2)(x, weights, ids), got)


def _expert_case(tokens: int, hidden: int, inter: int, k: int):
    """Strided bf16 rows, 32 experts' bf16 weights, their routing and the float32 reference loop's
    output: (x, w13, w2, weights, ids, reference)."""
    g = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    experts = 32
    x = torch.randn(tokens, 2 * hidden, device="cuda", generator=g).bfloat16()[:, :hidden]  # strided rows
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    weights, ids = moe.select_experts(torch.randn(tokens, experts, device="cuda", generator=g).bfloat16(), k, True)
    return x, w13, w2, weights, ids, moe.moe_forward_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)


def _experts_layer(w13: torch.Tensor, w2: torch.Tensor):
    experts, hidden, inter = w2.shape
    layer = moe.FusedExperts(experts, hidden, inter).cuda().bfloat16()
    layer.w13_weight.copy_(w13)
    layer.w2_weight.copy_(w2)
    return layer
