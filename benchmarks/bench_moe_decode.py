"""A mixture-of-experts layer at decode on the GPU: the grouped-GEMM path (`moe.moe_forward_grouped`,
torch's router ops) against the few-token kernels (`moe_ops.route` + `moe_ops.few_token_experts`)
and the expert-sorted ones (`moe_ops.sorted_experts`), router included, at 1-128 tokens, for the
Qwen3-Omni talker's and thinker's expert shapes in bf16. Each layer is timed inside a CUDA graph of
12 layers with distinct weights (no expert stays in L2), against the floor: the routed experts'
weights read once at the HBM bandwidth (at most every expert's). `moe.FEW_ROUTED_BYTES_MAX` and
`moe.SORTED_TOKEN_MAX` are where each stops winning.

    python benchmarks/bench_moe_decode.py
"""
from __future__ import annotations

import torch

from bench_small_linear import HBM_BYTES_PER_S  # benchmarks/ (the script's folder)
from graph_timing import graph_us_per_call
from vllm_omni.model_executor.layers import moe, moe_ops

LAYERS = 12
SHAPES = {  # name: (experts, hidden, moe intermediate, top-k)
    "qwen3-omni talker": (128, 1024, 384, 6),
    "qwen3-omni thinker": (128, 2048, 768, 8),
}


def torch_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.select_experts`' torch ops (what the grouped path ran with before the route kernel)."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), ids


def main() -> None:
    print(f"{'experts of':20s} tokens  floor us  grouped us  few-token us  sorted us")
    for name, (experts, hidden, inter, k) in SHAPES.items():
        layers = [((torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5).bfloat16(),
                   (torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5).bfloat16(),
                   torch.randn(hidden, experts, device="cuda").bfloat16()) for _ in range(LAYERS)]
        for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
            x = torch.randn(tokens, hidden, device="cuda").bfloat16()
            routed = min(experts, tokens * k)
            floor = routed * 3 * inter * hidden * 2 / HBM_BYTES_PER_S * 1e6
            grouped = graph_us_per_call(lambda: [moe.moe_forward_grouped(x, w13, w2, *torch_router(x @ gate, k))
                                                 for w13, w2, gate in layers], LAYERS)
            few = graph_us_per_call(lambda: [moe_ops.few_token_experts(x, w13, w2, *moe_ops.route(x @ gate, k, True))
                                             for w13, w2, gate in layers], LAYERS)
            ordered = graph_us_per_call(lambda: [moe_ops.sorted_experts(x, w13, w2, *moe_ops.route(x @ gate, k, True))
                                                 for w13, w2, gate in layers], LAYERS)
            print(f"{name:20s} {tokens:6d} {floor:9.1f} {grouped:11.1f} {few:13.1f} {ordered:10.1f}", flush=True)
        del layers


if __name__ == "__main__":
    main()
