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


def _replay_ms(graphs, batch: int, iters: int) -> float | None:
    """Mean ms of the smallest captured bucket that holds `batch` (`graphs.sizes`, `graphs.graphs`)."""
    if graphs is None or not graphs.graphs:
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
