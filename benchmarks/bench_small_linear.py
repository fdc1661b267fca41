"""Decode-time x @ W^T on the GPU: cuBLAS (`F.linear`) against `cuda_ops.small_m_linear` at 1, 2
and 4 rows, for the weight shapes of the Qwen2.5-Omni talker, the Qwen3 code predictors, the
7B thinker and the TTS talker's down product, in bf16. Each call is timed inside a CUDA graph of 24 calls on 24 distinct weights
(so no weight stays in L2), against the floor: the weight read once at the HBM bandwidth.
`layers/linear.linear` sends a product to our kernel where this table says it wins.

    python benchmarks/bench_small_linear.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graph_timing import graph_us_per_call  # benchmarks/ (the script's folder)
from vllm_omni.model_executor.layers import cuda_ops

HBM_BYTES_PER_S = 4.27e12  # device-to-device copy bandwidth measured on the H200 (notes/gpu.md)
CALLS = 24
SHAPES = {  # name: (N, K) of the weight
    "qwen2_5 talker qkv": (2560, 896), "qwen2_5 talker o": (896, 1536),
    "qwen2_5 talker gate_up": (37888, 896), "qwen2_5 talker down": (896, 18944),
    "qwen2_5 talker lm_head": (8448, 896),
    "predictor qkv": (4096, 1024), "predictor o": (1024, 2048), "predictor gate_up": (6144, 1024),
    "predictor down": (1024, 3072), "predictor lm_head": (2048, 1024),
    "7B thinker qkv": (4608, 3584), "7B thinker o": (3584, 3584), "7B thinker down": (3584, 18944),
    "tts talker down": (2048, 6144),
}


def main() -> None:
    print(f"{'weight':24s} {'N x K':>12s} rows  floor us  cuBLAS us  ours us")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(CALLS)]
        floor = n * k * 2 / HBM_BYTES_PER_S * 1e6
        for rows in (1, 2, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(cuda_ops.small_m_linear(x, weights[0]), F.linear(x, weights[0]),
                                       atol=2e-2, rtol=2e-2)
            theirs = graph_us_per_call(lambda: [F.linear(x, w) for w in weights], CALLS)
            ours = graph_us_per_call(lambda: [cuda_ops.small_m_linear(x, w) for w in weights], CALLS)
            print(f"{name:24s} {f'{n} x {k}':>12s} {rows:4d} {floor:9.1f} {theirs:10.1f} {ours:8.1f}", flush=True)
        del weights


if __name__ == "__main__":
    main()
