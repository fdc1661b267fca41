"""A decoder layer's RMSNorm and the product after it at decode rows: our fused kernel
(`cuda_ops.norm_linear`: the residual add, the norm, the product and, for gate/up, the gated SiLU
in one launch) against the separate kernels it replaces (`cuda_ops.rms_norm`, `layers/linear.linear`,
`cuda_ops.silu_and_mul`), in bf16. Each sequence is timed inside a CUDA graph of 24 calls on 24
distinct weights (no weight stays in L2), against the floor: the weight read once at the HBM
bandwidth. `--sweep` also times each program shape of a list.

    python benchmarks/bench_norm_linear.py [--sweep]
"""
from __future__ import annotations

import argparse

import torch

from bench_small_linear import CALLS, HBM_BYTES_PER_S, us_per_call  # benchmarks/ (the script's folder)
from vllm_omni.model_executor.layers import cuda_ops
from vllm_omni.model_executor.layers.linear import linear

SHAPES = {  # name: (N of the weight, K, gated, bias)
    "qwen2_5 talker qkv": (2560, 896, False, True), "qwen2_5 talker gate_up": (37888, 896, True, False),
    "predictor qkv": (4096, 1024, False, False), "predictor gate_up": (6144, 1024, True, False),
    "qwen3 talker qkv": (4096, 1024, False, False),
    "7B thinker qkv": (4608, 3584, False, True), "7B thinker gate_up": (37888, 3584, True, False),
}
SWEEP = [(2, 1024, 4), (4, 1024, 4), (4, 1024, 8), (8, 1024, 8), (8, 512, 4), (16, 512, 8), (16, 256, 4),
         (8, 256, 4), (32, 128, 4), (32, 256, 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time each (block_n, block_k, warps) of SWEEP")
    args = p.parse_args()
    print(f"{'product':24s} {'N x K':>12s} rows  floor us  separate us  fused us  max err")
    for name, (n, k, gated, has_bias) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(CALLS)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        norm_w = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        floor = n * k * 2 / HBM_BYTES_PER_S * 1e6
        for rows in (1, 2):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def separate(w):
                normed, _ = cuda_ops.rms_norm(x, norm_w, 1e-6, res)
                out = linear(normed, w, bias)
                return cuda_ops.silu_and_mul(out) if gated else out

            def fused(w, **cfg):
                return cuda_ops.norm_linear(x, norm_w, 1e-6, w, bias, res, gated, **cfg)[0]

            err = (fused(weights[0]).float() - separate(weights[0]).float()).abs().max().item()
            theirs = us_per_call(lambda: [separate(w) for w in weights])
            ours = us_per_call(lambda: [fused(w) for w in weights])
            print(f"{name:24s} {f'{n} x {k}':>12s} {rows:4d} {floor:9.1f} {theirs:12.1f} {ours:9.1f} {err:8.4f}",
                  flush=True)
            if args.sweep:
                for bn, bk, nw in SWEEP:
                    cfg = dict(block_n=bn, block_k=bk, num_warps=nw)
                    t = us_per_call(lambda: [fused(w, **cfg) for w in weights])
                    print(f"    block_n {bn:3d} block_k {bk:5d} warps {nw}: {t:8.1f} us", flush=True)
        del weights


if __name__ == "__main__":
    main()
