"""The token2wav DiT evaluation replayed from CUDA graphs, one per input shape.

A DiT evaluation (22 layers, guided and unguided rows) is ~450 kernel launches whatever its
size, and a chunk's ODE runs 36 of them: at the shapes of streaming windows (a few blocks,
one or a few rows) the GPU waits on the launches, not on the work. Shapes repeat (a stream's
windows are whole blocks: first, middle and last windows), so each (rows, frames, precision)
shape is captured once, on first use, and replayed after; the first `MAX_GRAPHS` shapes get
graphs, later new shapes run eagerly. Same kernels as the eager call: outputs are equal.
VLLM_OMNI_DIT_CUDA_GRAPHS=0 turns it off (stage processes inherit it).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

import vllm_omni.envs as envs
from vllm_omni.model_executor.graph_capture import capturing
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_dit import forward_cfg

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64


def dit_graphs_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and envs.DIT_CUDA_GRAPHS.get()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static x, conditioning, codes, speaker, feats, lengths
    output: torch.Tensor


class DiTGraphs:
    """Callable like `forward_cfg(dit, x, conditioning, codes, speaker, feats, lengths)`."""

    def __init__(self) -> None:
        self.captured: dict[tuple, _Captured] = {}
        self.pool = None

    def __call__(self, dit, *inputs: torch.Tensor) -> torch.Tensor:
        key = (torch.is_autocast_enabled("cuda"), *((t.shape, t.dtype) for t in inputs))
        entry = self.captured.get(key)
        if entry is None:
            if len(self.captured) >= MAX_GRAPHS:
                return forward_cfg(dit, *inputs)
            entry = self.captured[key] = self._capture(dit, inputs)
        for static, value in zip(entry.inputs, inputs):
            static.copy_(value)
        entry.graph.replay()
        return entry.output.clone()  # RK4 holds several evaluations at once

    def _capture(self, dit, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        static = tuple(t.clone() for t in inputs)
        # Under bf16 autocast the weight casts must be inside the graph: autocast's cache would
        # hand the capture tensors that are freed when the caller's autocast region ends.
        uncached = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                    if torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with uncached, torch.cuda.stream(stream):  # warm-up off the capture, as torch.cuda.graphs asks
            forward_cfg(dit, *static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with uncached, capturing(graph, self.pool):
            output = forward_cfg(dit, *static)
        self.pool = self.pool or graph.pool()
        logger.info("token2wav: captured a DiT graph for x %s (%d shapes)", tuple(inputs[0].shape),
                    len(self.captured) + 1)
        return _Captured(graph, static, output)
