"""The decode CUDA graph of an engine replayed alone: device time without host work."""
from __future__ import annotations

import torch


def graph_replay_ms(engine, batch: int, iters: int = 50) -> float | None:
    """GPU time of the decode graph alone (no scheduling, input preparation or sampling):
    the difference to ms/step is host overhead."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
