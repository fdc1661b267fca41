"""CUDA graphs of a causal codec decoder's calls on small code windows (streamed chunks).

A streamed chunk is a few frames per request, and the decoder (a transformer, then convolution
and upsampling blocks) launches a few thousand kernels per call whatever its size: on the H200
a Qwen3-TTS chunk costs ~20 ms of host time for ~4 ms of GPU work. `DecoderGraphs` replays one
captured graph per (rows, frames) bucket instead: rows are padded with code 0 and frames on the
right. Padding is harmless only for a decoder whose samples of frame t depend on frames <= t
and whose rows are independent (the caller's promise), and the padded rows' and frames' samples
are the caller's to ignore. `capture_all` captures every bucket of at most `max_frames` frames and
`max_rows` x `max_frames` frame-rows (a call of 4 full windows; more rows of shorter windows)
at load, into one memory pool (their outputs are copied out before the next replay): a capture
synchronizes the device and empties the allocator's cache, which a serving process must not do
between steps. Larger calls run eagerly (a call of many long windows is GPU-bound: padding it
would only add work), as does everything on the CPU.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vllm_omni.model_executor.graph_capture import capturing

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# From ~5 rows of full windows a call is GPU-bound and padding it to a bucket only adds work (H200,
# Qwen3-TTS at 64 in flight: first audio 258 -> 497 ms p90 with graphs of up to 64 rows of any
# length). Calls of many short windows (every new stream's first chunk, a few frames each) stay
# launch-bound: graphed up to the same frame-rows.
MAX_ROWS = 4


def bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def graph_buckets(max_frames: int, max_rows: int = MAX_ROWS) -> list[tuple[int, int]]:
    """The (rows, frames) buckets that replay a graph: windows of up to `max_frames` frames, at
    most `max_rows` full windows' worth of frame-rows (more rows when their windows are short)."""
    frames_limit = bucket(min(max_frames, BUCKETS[-1]))
    budget = min(max_rows, BUCKETS[-1]) * frames_limit
    return [(r, f) for r in BUCKETS for f in BUCKETS if f <= frames_limit and r * f <= budget]


class DecoderGraphs:
    def __init__(self, decoder: Callable[[torch.Tensor], torch.Tensor], num_quantizers: int,
                 max_frames: int = BUCKETS[-1], max_rows: int = MAX_ROWS) -> None:
        self.decoder = decoder
        self.num_quantizers = num_quantizers
        self.max_frames = min(max_frames, BUCKETS[-1])
        self.buckets = set(graph_buckets(max_frames, max_rows))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, skip_frames: int = 0) -> torch.Tensor:
        """The decoder's output for codes [rows, num_quantizers, frames]: rows x (at least) the
        frames' samples, on the device; valid until the next call. `skip_frames` > 0 (a decoder
        whose `decoder(codes, skip_frames)` leaves out the samples of the first frames, and whose
        output is samples_per_frame per frame): the samples from that frame on."""
        rows, _, frames = codes.shape
        key = (bucket(rows), bucket(frames))
        if not codes.is_cuda or frames > self.max_frames or key not in self.buckets:
            return self.decoder(codes, skip_frames) if skip_frames else self.decoder(codes)
        if key not in self._graphs:  # not captured at load (capture_all): capture now
            self._graphs[key] = self._capture(*key, codes.device)
        graph, static_in, static_out = self._graphs[key]
        static_in.zero_()
        static_in[:rows, :, :frames].copy_(codes)
        graph.replay()  # the whole window (a graph per skip would multiply the graphs)
        return static_out[:rows, ..., skip_frames * (static_out.shape[-1] // key[1]):]

    @torch.inference_mode()
    def capture_all(self, device: torch.device) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its pool memory)."""
        keys = sorted(self.buckets, key=lambda k: k[0] * k[1], reverse=True)
        for key in keys:
            self._graphs[key] = self._capture(*key, device)
        logger.info("captured %d decoder CUDA graphs (up to %d rows x %d frames, %d frame-rows)", len(keys),
                    max(r for r, _ in keys), self.max_frames, max(r * f for r, f in keys))

    def _capture(self, rows: int, frames: int, device: torch.device):
        static_in = torch.zeros(rows, self.num_quantizers, frames, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the capture (cuDNN picks its algorithms)
            self.decoder(static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        with capturing(graph, self._pool):
            static_out = self.decoder(static_in)
        logger.debug("captured a decoder CUDA graph for %d rows x %d frames", rows, frames)
        return graph, static_in, static_out
