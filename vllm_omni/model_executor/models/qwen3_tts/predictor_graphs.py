"""The code predictor's whole frame (groups 1..G-1) as one CUDA graph per batch bucket.

Eagerly, a frame costs G-1 small decoder passes plus sampling: ~1000 kernel launches for the
released model (15 groups x 5 layers), which dominate a decode step at small batch. Here the
frame's computation is a fixed-shape function of static buffers, sampling included:

    code = argmax(logits)                                   greedy rows
    code = argmax(softmax(top_k(logits / T)) / q)            sampled rows, q ~ Exp(1) noise

(our Sampler's exponential race at qwen-tts' subtalker settings). The noise is drawn before
each replay, from a request's own generator when it has a seed, so seeded requests are
reproducible; the draws differ from the eager path's, the distribution does not.

`run(...)` replays on CUDA; `PredictorFrame.__call__` is the same function run eagerly (what
the CPU tests compare with the eager path).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class PredictorFrame:
    """Static buffers and the frame function over them (batch rows first, padded to a bucket)."""

    def __init__(self, predictor: nn.Module, max_batch: int, width: int, vocab: int, temperature: float,
                 top_k: int, device: torch.device, dtype: torch.dtype) -> None:
        self.predictor = predictor
        self.groups = predictor.num_code_groups - 1
        self.temperature = temperature
        self.top_k = min(top_k, vocab)
        self.hidden = torch.zeros(max_batch, width, dtype=dtype, device=device)
        self.first = torch.zeros(max_batch, width, dtype=dtype, device=device)
        self.noise = torch.ones(max_batch, self.groups, vocab, dtype=torch.float32, device=device)
        self.greedy = torch.ones(max_batch, dtype=torch.bool, device=device)

    def __call__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        greedy, noise = self.greedy[:b], self.noise[:b]

        def sample(logits: torch.Tensor, group: int) -> torch.Tensor:
            scaled = logits / self.temperature
            kth = scaled.topk(self.top_k, dim=-1).values[:, -1:]
            probs = scaled.masked_fill(scaled < kth, float("-inf")).softmax(dim=-1)
            return torch.where(greedy, logits.argmax(dim=-1), (probs / noise[:, group]).argmax(dim=-1))

        return self.predictor(self.hidden[:b], self.first[:b], sample)

    def load(self, hidden: torch.Tensor, first: torch.Tensor, greedy: list[bool],
             generators: list[torch.Generator | None]) -> None:
        """Fill rows [0, B) for one frame; padded rows keep whatever they held (their output is dropped)."""
        b = hidden.shape[0]
        self.hidden[:b].copy_(hidden)
        self.first[:b].copy_(first)
        self.greedy[:b].copy_(torch.tensor(greedy), non_blocking=True)
        if not all(greedy):
            self.noise[:b].exponential_()
            for i, g in enumerate(generators):
                if g is not None and not greedy[i]:
                    self.noise[i].exponential_(generator=g)


class PredictorGraphs:
    """Captured on first use, one graph per batch bucket up to `max_batch`."""

    def __init__(self, frame: PredictorFrame, max_batch: int) -> None:
        self.frame = frame
        self.sizes = [s for s in _BUCKETS if s < max_batch] + [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.frame(b)  # warm-up (Triton compiles outside the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.frame(b)
            pool = pool or graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured code predictor CUDA graphs for batch sizes %s", self.sizes)

    def run(self, hidden: torch.Tensor, first: torch.Tensor, greedy: list[bool],
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        b = hidden.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.frame.load(hidden, first, greedy, generators)
        self.graphs[size].replay()
        codes, embeds = self.outputs[size]
        return codes[:b].clone(), embeds[:b].clone()
