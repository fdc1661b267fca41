"""One request's streaming decode for Qwen3-Omni code2wav (`stage_io.StreamingDecoder`).

Codec frames ([num_quantizers] codes, 80 ms of audio each at 12.5 Hz) arrive by `push`. The
stream cuts them into chunks (`ChunkRamp`: 4 frames, then 4, 8, 16, 25, 25, ... by default) and
decodes each chunk as one window: the chunk plus up to `left_context_frames` frames before
it, like transformers' `chunked_decode` (whose defaults, 25 frames of context, it keeps).

Chunk boundaries depend only on the schedule and the total length, never on when frames
arrived, so the same codes give the same audio however the talker's output was split. A
chunk that the final push cuts short is decoded at its remaining length.

Only the frames a later window may still need are kept (the left context), so memory stays
bounded however long the request runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.model_executor.models.codec_streaming import ChunkRamp, RowBuffer
from vllm_omni.model_executor.models.stream_options import StreamOptions


@dataclass(frozen=True)
class Code2WavStreamConfig(StreamOptions):
    """Chunking of the streaming code2wav decode (docs/streaming.md says why these defaults).
    Connector options: upstream vLLM-Omni's names."""

    OPTION_KEYS = {"initial_codec_chunk_frames": "initial_chunk_frames", "codec_chunk_frames": "chunk_frames",
                   "codec_left_context_frames": "left_context_frames",
                   "codec_chunk_ramp_divisor": "chunk_ramp_divisor"}  # ours, not upstream's

    initial_chunk_frames: int = 4  # 320 ms of audio: the first chunk waits for 4 talker frames
    chunk_frames: int = 25  # upstream's codec_chunk_frames: 2 s of audio per steady chunk
    left_context_frames: int = 25  # transformers' chunked_decode left_context_size
    chunk_ramp_divisor: int = 1  # each ramp chunk is all before it over this (ChunkRamp.divisor)

    def __post_init__(self) -> None:
        _ = self.ramp  # ChunkRamp checks the sizes
        # A chunk re-decodes the samples its predecessor could not finish (the decoder's
        # transposed convolutions need one frame to the right): that takes >= 1 frame of context.
        if self.left_context_frames < 1:
            raise ValueError(f"left_context_frames must be >= 1, got {self.left_context_frames}")

    @property
    def ramp(self) -> ChunkRamp:
        # initial 0 is upstream's "no small first chunk": every chunk is chunk_frames long.
        return ChunkRamp(self.initial_chunk_frames or self.chunk_frames, self.chunk_frames, self.chunk_ramp_divisor)


@dataclass(frozen=True)
class Code2WavWindow:
    """The next chunk of a stream: `codes` [num_quantizers, context + chunk frames]."""

    codes: torch.Tensor
    context: int  # frames of left context at the start of `codes`
    end: int  # frame index (of the whole request) where the chunk ends


class Code2WavStream:
    """`stage_io.StreamingDecoder` of one request; `Qwen3OmniMoeCode2Wav.decode_streams` runs it."""

    def __init__(self, request_id: str, num_quantizers: int, codebook_size: int,
                 config: Code2WavStreamConfig, reference_frames: int = 0) -> None:
        """`reference_frames`: leading frames that are context only (a cloned voice's reference,
        Qwen3-TTS): the first chunk begins after them, with them as its left context, and their
        own audio is never decoded."""
        self.request_id = request_id
        self.num_quantizers = num_quantizers
        self.codebook_size = codebook_size
        self.config = config
        self._ramp = config.ramp
        self._frames = RowBuffer(torch.zeros(0, num_quantizers, dtype=torch.long))  # [n, num_quantizers]
        self._decoded = reference_frames
        self._chunks = 0
        self._final = False
        self.sent_sample_rate = False

    # ------------------------------------------------------------------ StreamingDecoder
    def push(self, units: torch.Tensor, final: bool) -> None:
        """Append codec frames [n, num_quantizers] (n may be 0 with `final`), no stop-token frame."""
        if self._final:
            raise ValueError(f"request {self.request_id}: frames pushed after the final push")
        frames = torch.as_tensor(units)
        if frames.dim() != 2 or frames.shape[1] != self.num_quantizers or frames.dtype.is_floating_point:
            raise ValueError(f"request {self.request_id}: expected integer codec frames [n, {self.num_quantizers}], "
                             f"got {tuple(frames.shape)} {frames.dtype}")
        if frames.numel() and not (0 <= int(frames.min()) and int(frames.max()) < self.codebook_size):
            raise ValueError(f"request {self.request_id}: codec codes must lie in [0, {self.codebook_size})")
        self._frames.append(frames.to(torch.long).cpu())
        self._final = final
        if final and self._frames.end < self._decoded:
            raise ValueError(f"request {self.request_id}: the stream ended inside its {self._decoded} reference "
                             f"frames ({self._frames.end} frames)")

    def ready(self) -> bool:
        if self._decoded >= self._frames.end:
            return False
        return self._final or self._frames.end >= self._decoded + self._ramp.size(self._chunks)

    @property
    def finished(self) -> bool:
        return self._final and self._decoded == self._frames.end

    @property
    def consumed(self) -> int:
        return self._decoded

    @property
    def decoded_chunks(self) -> int:
        return self._chunks

    # ------------------------------------------------------------------ used by the model
    def next_window(self) -> Code2WavWindow:
        """The next chunk to decode (call only when `ready()`)."""
        if not self.ready():
            raise RuntimeError(f"request {self.request_id}: no chunk is ready to decode")
        start, end, context = self._next_span()
        return Code2WavWindow(codes=self._frames.get(start - context, end).T.contiguous(), context=context, end=end)

    def next_window_frames(self) -> int:
        """Frames of the next window (context and chunk), without building it."""
        start, end, context = self._next_span()
        return context + end - start

    def _next_span(self) -> tuple[int, int, int]:
        start = self._decoded
        end = min(start + self._ramp.size(self._chunks), self._frames.end)
        return start, end, min(self.config.left_context_frames, start)

    def commit(self, window: Code2WavWindow) -> None:
        """The window was decoded: move on and forget frames no later window needs."""
        self._decoded = window.end
        self._chunks += 1
        self._frames.drop_before(self._decoded - self.config.left_context_frames)
