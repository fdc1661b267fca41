"""Capturing one CUDA graph per bucket size, what the engine's decode and prefill graphs and the
code predictors' frame graphs share."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


@torch.inference_mode()
def capture_buckets(sizes: list[int], run: Callable[[int], Any],
                    before: Callable[[int], None] | None = None) -> tuple[dict[int, torch.cuda.CUDAGraph], dict]:
    """Graphs of `run(size)` for every size and their static outputs, largest first, so that the
    smaller graphs reuse the largest one's memory pool. `run` is called once before each capture
    (Triton compiles and autotunes outside it); `before(size)` prepares the inputs, uncaptured."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Any] = {}
    pool = None
    for size in sorted(sizes, reverse=True):
        if before is not None:
            before(size)
        run(size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = run(size)
        pool = pool or graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs
