"""Capturing CUDA graphs: `capturing`, which every capture in the package goes through, and one
graph per bucket size, what the engine's decode and prefill graphs and the code predictors'
frame graphs share."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_ONE_CAPTURE_AT_A_TIME = threading.Lock()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)` for stages that may share this process as threads
    (`runtime.process: false`): one capture at a time (two at once invalidate each other,
    cudaErrorStreamCaptureInvalidated), and in thread-local mode, so that a neighbour thread's
    allocations and waits during the capture are not errors of this capture."""
    with _ONE_CAPTURE_AT_A_TIME, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield


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
        with capturing(graph, pool):
            outputs[size] = run(size)
        pool = pool or graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs
