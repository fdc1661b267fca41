"""The interface between a generation stage and its model: every hook the runtime calls, with defaults.

A generation model runs one pass per batch of whole requests (code2wav, token2wav: codec codes in,
audio out), where the AR engine would run one step per token. It subclasses `GenerationModel` and
declares what it does with the class attributes below; the worker and the engine read them and
call the hooks, and never probe a model for a method (as `StageModel` is for AR models).

The runtime calls, in order:
  cls.supports_cuda_graphs, cls.stream_config(options)  # the worker, before loading
  model = cls.load(model_path, model_stage=..., device=..., dtype=..., load_format=...,
                   [stream_config=...], [cuda_graphs=...])  # once; the bracketed ones as declared
  model.overlaps_first_chunks                         # once, when the engine picks its decode lanes
  model.generate_batch([request, ...])                # each step with whole requests queued
A request whose input streams in (a streaming edge from a talker; only when
`accepts_streamed_input`) instead gets
  decoder = model.open_stream(request)                # once, when it arrives (stage_io.StreamingDecoder)
  decoder.push(units, final)                          # as its input streams in
  n = model.streams_per_step(decoders)                # each step with decoders ready
  model.decode_streams(decoders[:n])                  # one chunk of each (may run on a background lane)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vllm_omni.model_executor.models.stream_options import StreamOptions
from vllm_omni.stage_io import StageRequest, StreamingDecoder

Results = list[dict[str, torch.Tensor]]  # one dict of named tensors per request, in order


class GenerationModel:
    """Base class of every single-pass stage model (see the module docstring)."""

    # --- what the model does (read by the worker and the engine) -----------------------
    # `load` takes `cuda_graphs` (True unless enforce_eager): the model captures graphs of its own.
    supports_cuda_graphs: ClassVar[bool] = False
    # The chunking config `load` takes as `stream_config`, built from the options of the
    # connector on the stage's input edge (stream_options.py); None: it takes none.
    stream_options_type: ClassVar[type[StreamOptions] | None] = None
    accepts_streamed_input: ClassVar[bool] = False  # open_stream / decode_streams
    # Streaming models: the most units a decoder may wait for before it can decode (a chunk and
    # its look-ahead). Flow control never holds the producer back below that.
    max_units_per_chunk: int = 0
    # A call of only new streams' first chunks may run while a call of later chunks is still on
    # the GPU (worker/decode_lanes.py): the model keeps what the two write apart (its graphs' memory).
    overlaps_first_chunks: bool = False

    @classmethod
    def stream_config(cls, options: Mapping[str, Any]) -> StreamOptions:
        """The `stream_config` to load with, from these connector options; ValueError when the
        model takes no options or cannot use these."""
        if cls.stream_options_type is None:
            raise ValueError(f"{cls.__name__} takes no chunk options (it declares no stream_options_type), "
                             f"got {', '.join(options)}")
        return cls.stream_options_type.from_options(options)

    # --- required ------------------------------------------------------------------------
    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None, device: torch.device, dtype: str,
             load_format: str = "auto") -> GenerationModel:
        """The model on `device`; load_format "dummy": random weights, nothing read."""
        raise NotImplementedError

    def generate_batch(self, inputs: list[StageRequest]) -> Results:
        """One pass over whole requests: one dict of named tensors each, in order."""
        raise NotImplementedError

    # --- streamed input (when accepts_streamed_input) -------------------------------------
    def open_stream(self, req: StageRequest) -> StreamingDecoder:
        """A decoder for a request whose input streams in (its first units may be in `req`)."""
        raise NotImplementedError(f"{type(self).__name__} does not take streamed input")

    def streams_per_step(self, decoders: list[StreamingDecoder]) -> int:
        """How many of these ready decoders (in the engine's order) one `decode_streams` call
        should take: all by default; fewer where a larger call would only make a new stream's
        first chunk wait longer behind it."""
        return len(decoders)

    def decode_streams(self, decoders: list[StreamingDecoder]) -> Results:
        """One chunk of each decoder; tensors may stay on the model's device (the engine copies
        them out)."""
        raise NotImplementedError(f"{type(self).__name__} does not take streamed input")
