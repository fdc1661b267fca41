"""A code predictor's whole frame (groups 1..G-1) as one CUDA graph per batch bucket.

Qwen3-Omni's and Qwen3-TTS's talkers run a small code predictor after each sampled group-0
code: G-1 tiny decoder passes plus sampling, ~1000 kernel launches per frame for the released
models (15 groups x 5 layers), which dominate a decode step at small batch. Here the frame is
a fixed-shape function of static buffers, sampling included (`sample_codes`):

    code = argmax(logits)                                         greedy rows
    code = argmax(top_k_top_p(logits / T) + g)                    sampled rows, g ~ Gumbel(0, 1)

the Gumbel-max form of our Sampler's exponential race (argmax p / q = argmax log p - log q),
at the predictor's sampling settings (predictor_sampling.py, fixed once the graphs are captured). On CUDA it is one kernel per group
(`sampling_ops.sample_codes`: each row sorted in one program's registers), where torch's ops took a
dozen launches per group, ~3-5 us each at a handful of rows. The noise is drawn before each
replay, from a request's own generator when it has a seed, so seeded requests are
reproducible; the draws differ from the eager path's, the distribution does not
(tests/models/test_predictor_sampling.py).

`GraphedPredictor.predict` is what a talker calls: the graphs when the talker captured them at
load (its `capture_graphs`: on CUDA, unless enforce_eager), else the predictor run eagerly with
our Sampler. A capture synchronizes the device, so it happens at load and never while serving
(captured at the first frame, it cost the first request seconds: 7.3 s of a Qwen3-Omni talker's
first step under the profiler on the H200). `PredictorFrame.__call__` is the captured function run
eagerly (what the CPU tests compare with the eager predictor).
VLLM_OMNI_PREDICTOR_CUDA_GRAPHS=0 runs the predictor eagerly (stage processes inherit it).
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from vllm_omni.model_executor.device_copy import to_device_nowait
from vllm_omni.model_executor.graph_capture import capture_buckets
from vllm_omni.model_executor.layers.sampler import Sampler, SamplingBatch
from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling
from vllm_omni.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREDICTOR_GRAPHS_ENV = "VLLM_OMNI_PREDICTOR_CUDA_GRAPHS"
MAX_GRAPH_BATCH = 64  # larger batches replay the graphs in slices of at most this many rows
MAX_FUSED_VOCAB = 4096  # a row's sort stays in one program's registers
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def sample_codes(logits: torch.Tensor, greedy: torch.Tensor, gumbel: torch.Tensor, temperature: float,
                 top_k: int, top_p: float) -> torch.Tensor:
    """Codes [B] from logits [B, V] (any float dtype): argmax where `greedy` [B], else a draw from
    softmax(logits / T) restricted to the top-k and then to the top-p nucleus (the Sampler's rule,
    `apply_top_k_top_p`: top-k keeps every value >= the k-th largest; the nucleus keeps a token
    while the tokens above it hold less than p), by the Gumbel-max trick with noise `gumbel`
    [B, >= V]. top_k <= 0 or >= V: no top-k. On CUDA one kernel per call (`sampling_ops.sample_codes`)."""
    vocab = logits.shape[-1]
    if logits.is_cuda and vocab <= MAX_FUSED_VOCAB:
        from vllm_omni.model_executor.layers import sampling_ops

        return sampling_ops.sample_codes(logits, greedy, gumbel, temperature, top_k, top_p)
    logits = logits.float()
    best = logits.argmax(dim=-1)
    scaled = logits / temperature
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered = scaled.sort(dim=-1, descending=True).values
        probs = ordered.softmax(dim=-1)
        # The smallest value still in the nucleus; every token at or above it stays.
        last = ordered.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, float("inf")).amin(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(scaled < last, float("-inf"))
    drawn = (scaled + gumbel[:, :vocab]).argmax(dim=-1)
    return torch.where(greedy, best, drawn)


class PredictorFrame:
    """Static buffers and the frame function over them (batch rows first, padded to a bucket).

    `predictor(hidden, first, sample)` is the model's code predictor: it calls
    `sample(logits [B, V] float32, group)` once per residual group."""

    def __init__(self, predictor: nn.Module, max_batch: int, width: int, vocab: int, sampling: PredictorSampling,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.predictor = predictor
        self.groups = predictor.num_code_groups - 1
        self.temperature, self.top_k, self.top_p = sampling.temperature, sampling.top_k, sampling.top_p
        self.hidden = torch.zeros(max_batch, width, dtype=dtype, device=device)
        self.first = torch.zeros(max_batch, width, dtype=dtype, device=device)
        self.gumbel = torch.zeros(max_batch, self.groups, vocab, dtype=torch.float32, device=device)
        self.greedy = torch.ones(max_batch, dtype=torch.bool, device=device)

    def __call__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        greedy, gumbel = self.greedy[:b], self.gumbel[:b]

        def sample(logits: torch.Tensor, group: int) -> torch.Tensor:
            return sample_codes(logits, greedy, gumbel[:, group], self.temperature, self.top_k, self.top_p)

        return self.predictor(self.hidden[:b], self.first[:b], sample)

    def load(self, hidden: torch.Tensor, first: torch.Tensor, greedy: list[bool],
             generators: list[torch.Generator | None]) -> None:
        """Fill rows [0, B) for one frame; padded rows keep whatever they held (their output is dropped)."""
        b = hidden.shape[0]
        self.hidden[:b].copy_(hidden)
        self.first[:b].copy_(first)
        self.greedy[:b].copy_(to_device_nowait(torch.tensor(greedy), self.greedy.device), non_blocking=True)
        if not all(greedy):
            noise = self.gumbel[:b]
            noise.exponential_()
            for i, g in enumerate(generators):
                if g is not None and not greedy[i]:
                    noise[i].exponential_(generator=g)
            # -log Exp(1) ~ Gumbel(0, 1); the clamp keeps a draw of exactly 0 finite.
            noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_().neg_()


class PredictorGraphs:
    """One graph per batch bucket up to `max_batch`, captured at once."""

    def __init__(self, frame: PredictorFrame, max_batch: int) -> None:
        self.frame = frame
        self.sizes = [s for s in _BUCKETS if s < max_batch] + [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(self) -> None:
        self.graphs, self.outputs = capture_buckets(self.sizes, self.frame)
        logger.info("captured code predictor CUDA graphs for batch sizes %s", self.sizes)

    def run(self, hidden: torch.Tensor, first: torch.Tensor, greedy: list[bool],
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        b = hidden.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.frame.load(hidden, first, greedy, generators)
        self.graphs[size].replay()
        codes, embeds = self.outputs[size]
        return codes[:b].clone(), embeds[:b].clone()


_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class GraphedPredictor:
    """A talker's code predictor at its sampling settings (`sampling`, which decides per request
    whether a frame is greedy): its frame graphs once `capture` ran, else the predictor run eagerly."""

    def __init__(self, predictor: nn.Module, width: int, vocab: int, sampling: PredictorSampling) -> None:
        self.predictor, self.width, self.vocab, self.sampling = predictor, width, vocab, sampling
        self.graphs: PredictorGraphs | None = None
        self.sampler = Sampler()

    def configure(self, sampling: PredictorSampling) -> None:
        """New settings (the stage's subtalker_sampling_params), before the graphs bake them in."""
        if self.graphs is not None:
            raise RuntimeError("the code predictor's sampling is set before its graphs are captured")
        self.sampling = sampling

    def capture(self, like: torch.Tensor) -> None:
        """The frame graphs on `like`'s device and dtype (the talker's, at load)."""
        if os.environ.get(PREDICTOR_GRAPHS_ENV) == "0":
            return
        frame = PredictorFrame(self.predictor, MAX_GRAPH_BATCH, self.width, self.vocab, self.sampling,
                               like.device, like.dtype)
        self.graphs = PredictorGraphs(frame, MAX_GRAPH_BATCH)
        self.graphs.capture()

    def predict(self, requests: list, hidden: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [B, G-1], their embeddings) of the frames whose group-0 codes embed to `first`.

        With graphs, a batch over MAX_GRAPH_BATCH rows replays them slice by slice: the eager
        frame (a host wait per group, ~1000 launches) made a talker step of 65+ rows several times
        slower than one of 64, so past 64 requests in flight a TTS server fell behind for good."""
        if self.graphs is None:
            return self.predictor(hidden, first, self._sample_fn(requests))
        greedy, generators = self._greedy_rows(requests), [r.generator for r in requests]
        parts = [self.graphs.run(hidden[i: i + MAX_GRAPH_BATCH], first[i: i + MAX_GRAPH_BATCH],
                                 greedy[i: i + MAX_GRAPH_BATCH], generators[i: i + MAX_GRAPH_BATCH])
                 for i in range(0, hidden.shape[0], MAX_GRAPH_BATCH)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([codes for codes, _ in parts]), torch.cat([embeds for _, embeds in parts])

    def _greedy_rows(self, requests: list) -> list[bool]:
        return [self.sampling.greedy_for(r.sampling_params) for r in requests]

    def _sample_fn(self, requests: list):
        greedy = self._greedy_rows(requests)
        if all(greedy):
            return lambda logits, group: logits.argmax(dim=-1)
        n, sampled = len(requests), self.sampling.sampled_params()
        batch = SamplingBatch(params=[_GREEDY if g else sampled for g in greedy],
                              prompt_token_ids=[[]] * n, output_token_ids=[[]] * n,
                              generators=[r.generator for r in requests])
        return lambda logits, group: torch.tensor(self.sampler(logits, batch).token_ids, device=logits.device)
