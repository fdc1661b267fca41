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

A stream's steady chunks all have one shape: `steady=(frames, skip)`, the window of a full chunk
with its full left context, and the frames of that context whose samples the vocoder need not
compute (a decoder `decoder(codes, skip_frames)` whose vocoder starts there: both Qwen3
code2wavs). Those get graphs of their own for up to `steady_rows` rows, exactly that long and
trimmed, so that steady decoding runs in short replays (`StreamGraphs`: the engine decodes that
many steady streams per step, and a new stream's first chunk never waits behind a long eager
step).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

import vllm_omni.envs as envs
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
    def __init__(self, decoder: Callable[..., torch.Tensor], num_quantizers: int,
                 max_frames: int = BUCKETS[-1], max_rows: int = MAX_ROWS, *, samples_per_frame: int | None = None,
                 steady: tuple[int, int] | None = None, steady_rows: int = MAX_ROWS) -> None:
        """`samples_per_frame`: for `skip_frames` (default: the output's length over its frames).
        `steady`: (frames, skip) of the steady windows' graphs (module docstring)."""
        self.decoder = decoder
        self.num_quantizers = num_quantizers
        self.max_frames = min(max_frames, BUCKETS[-1])
        self.samples_per_frame = samples_per_frame
        # Keys (rows, frames, skip): the padded buckets decode whole windows (skip 0).
        self.buckets = {(r, f, 0) for r, f in graph_buckets(max_frames, max_rows)}
        if steady is not None and not (0 < steady[1] < steady[0]):
            raise ValueError(f"steady windows of {steady[0]} frames cannot skip {steady[1]}")
        self.steady = steady
        if steady is not None:
            self.buckets |= {(r, *steady) for r in BUCKETS if r <= steady_rows}
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, skip_frames: int = 0) -> torch.Tensor:
        """The decoder's output for codes [rows, num_quantizers, frames]: rows x (at least) the
        frames' samples, on the device; valid until the next call. `skip_frames` > 0 (a decoder
        whose `decoder(codes, skip_frames)` leaves out the samples of the first frames, and whose
        output is samples_per_frame per frame): the samples from that frame on."""
        rows, _, frames = codes.shape
        key = self._key(rows, frames, skip_frames)
        if not codes.is_cuda or key not in self.buckets:
            return self.decoder(codes, skip_frames) if skip_frames else self.decoder(codes)
        if key not in self._graphs:  # not captured at load (capture_all): capture now
            self._graphs[key] = self._capture(*key, codes.device)
        graph, static_in, static_out = self._graphs[key]
        static_in.zero_()
        static_in[:rows, :, :frames].copy_(codes)
        graph.replay()  # from the key's skip (0: the whole window; one graph per skip would multiply them)
        spf = self.samples_per_frame or static_out.shape[-1] // (key[1] - key[2])
        return static_out[:rows, ..., (skip_frames - key[2]) * spf:]

    def _key(self, rows: int, frames: int, skip_frames: int) -> tuple[int, int, int]:
        if self.steady is not None and frames <= self.steady[0] and skip_frames >= self.steady[1]:
            return bucket(rows), *self.steady
        return bucket(rows), bucket(frames) if frames <= self.max_frames else frames, 0

    @torch.inference_mode()
    def capture_all(self, device: torch.device) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its pool memory)."""
        keys = sorted(self.buckets, key=lambda k: k[0] * k[1], reverse=True)
        for key in keys:
            self._graphs[key] = self._capture(*key, device)
        logger.info("captured %d decoder CUDA graphs (up to %d rows x %d frames, %d frame-rows; steady windows: %s)",
                    len(keys), max(r for r, _, _ in keys), self.max_frames, max(r * f for r, f, _ in keys),
                    self.steady)

    def _capture(self, rows: int, frames: int, skip: int, device: torch.device):
        static_in = torch.zeros(rows, self.num_quantizers, frames, dtype=torch.long, device=device)

        def run() -> torch.Tensor:
            return self.decoder(static_in, skip) if skip else self.decoder(static_in)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the capture (cuDNN picks its algorithms)
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        with capturing(graph, self._pool):
            static_out = run()
        logger.debug("captured a decoder CUDA graph for %d rows x %d frames (from frame %d)", rows, frames, skip)
        return graph, static_in, static_out


class StreamGraphs:
    """The graphs of a streaming code2wav (Code2WavStream chunks), captured at load:

    - `later`: every window up to the longest (context + chunk), and the steady window trimmed
      to the vocoder's context (`steady`) where the decoder can skip frames;
    - `first`: new streams' first chunks, in a memory pool of their own, so that a call of them
      may replay while later chunks replay theirs (the engine's decode lanes);
    - `step_frame_budget`: the window frames one call of later chunks should hold (what the
      graphs hold: `rows` full windows), or None where steady graphs are off.
    """

    def __init__(self, decoder: Callable[..., torch.Tensor], num_quantizers: int, samples_per_frame: int,
                 config, vocoder_context_frames: int | None) -> None:
        """`config`: a Code2WavStreamConfig; `vocoder_context_frames`: None for a decoder
        without `decoder(codes, skip_frames)`."""
        context = config.left_context_frames
        longest = context + max(config.initial_chunk_frames, config.chunk_frames)
        skip = context - vocoder_context_frames if vocoder_context_frames is not None else 0
        # Rows of the steady windows' graphs, the most steady chunks a step takes. Fewer, shorter
        # steps let first chunks through sooner; more rows use the GPU better (H200, Qwen3-TTS: 4
        # rows gave Poisson first-audio p95 64-119 ms and ~190 audio s/s at 64 in flight, 8 rows
        # 131-217 ms and ~212; docs/benchmarks.md round 9). 0: no steady graphs, steps of any size.
        rows = envs.STEADY_CHUNK_GRAPHS.get()
        steady = (longest, skip) if skip > 0 and rows > 0 else None
        self.step_frame_budget = rows * longest if steady else None
        self.later = DecoderGraphs(decoder, num_quantizers, longest, samples_per_frame=samples_per_frame,
                                   steady=steady, steady_rows=rows)
        # A first chunk's context is a cloned voice's reference frames, if any. As many frame-rows
        # as the later graphs: a first step of every new stream at once stays one replay.
        first = context + config.ramp.size(0)
        self.first = DecoderGraphs(decoder, num_quantizers, first, samples_per_frame=samples_per_frame,
                                   max_rows=MAX_ROWS * bucket(min(longest, BUCKETS[-1])) // bucket(min(first, BUCKETS[-1])))

    def capture_all(self, device: torch.device) -> None:
        self.later.capture_all(device)
        self.first.capture_all(device)

    def for_streams(self, streams) -> DecoderGraphs:
        """The graphs of a call of these streams: `first` for new streams' first chunks only."""
        return self.first if all(s.decoded_chunks == 0 for s in streams) else self.later


def streams_within_budget(graphs: StreamGraphs | None, streams: list) -> int:
    """A code2wav's `streams_per_step`: the streams whose next windows the graphs hold in one
    call (at least one); all of them without graphs (one call of many windows is GPU-bound)."""
    if graphs is None or graphs.step_frame_budget is None:
        return len(streams)
    total = 0
    for n, stream in enumerate(streams):
        total += stream.next_window_frames()
        if total > graphs.step_frame_budget and n:
            return n
    return len(streams)
