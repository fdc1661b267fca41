"""CUDA graphs of an engine replayed alone: device time without host work."""
from __future__ import annotations

import torch


def graph_replay_ms(engine, batch: int, iters: int = 50) -> float | None:
    """GPU time of the decode graph alone (no scheduling, input preparation or sampling):
    the difference to ms/step is host overhead."""
    return _replay_ms(engine.runner.graphs, batch, iters)


def predictor_replay_ms(engine, batch: int, iters: int = 50) -> float | None:
    """GPU time of a talker's code predictor frame graph alone (Qwen3-Omni, Qwen3-TTS), else None."""
    predictor = getattr(engine.model, "graphed_predictor", None)
    return _replay_ms(predictor.graphs if predictor is not None else None, batch, iters)


def graph_us_per_call(fn, calls: int, iters: int = 20) -> float:
    """Device us per call of `fn`, which makes `calls` calls: captured once in a CUDA graph (after a
    warm-up run that compiles its kernels), then replayed `iters` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _mean_replay_ms(graph, iters) / calls * 1e3


def _replay_ms(graphs, batch: int, iters: int) -> float | None:
    """Mean ms of the smallest captured bucket that holds `batch` (`graphs.sizes`, `graphs.graphs`)."""
    if graphs is None or not graphs.graphs:
        return None
    size = next(s for s in graphs.sizes if s >= batch)
    return _mean_replay_ms(graphs.graphs[size], iters)


def _mean_replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
