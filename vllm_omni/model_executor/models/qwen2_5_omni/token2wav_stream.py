"""One request's streaming decode for Qwen2.5-Omni token2wav (`stage_io.StreamingDecoder`).

Codec codes (50 Hz, 2 mel frames each) arrive by `push`. Chunks follow the DiT's block
attention: a chunk is a whole number of blocks (24 mel frames = 12 codes released), and it
is decoded as one flow-matching window of the chunk plus `past_blocks` before it and
`future_blocks` after it, the blocks its look-back and look-ahead layers attend to. So a
chunk waits for its look-ahead blocks of codes (and one code more, `settle_codes`). Its mel is
then vocoded with overlap-save (token2wav_vocoder.py): the last `vocoder_context_frames` mel
frames of a chunk are held back until the next chunk gives them their right context.

The noise of each window is its rows of the whole request's one draw (token2wav_noise.py);
chunk boundaries depend only on the schedule and the total length, never on when codes arrived.
Only the codes, noise and mel a later window still needs are kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.model_executor.models.codec_streaming import ChunkRamp, RowBuffer
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_noise import StreamNoise
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_vocoder import VocoderWindow
from vllm_omni.model_executor.models.stream_options import StreamOptions


@dataclass(frozen=True)
class Token2WavStreamConfig(StreamOptions):
    """Chunking of the streaming token2wav decode, in DiT blocks and mel frames (docs/streaming.md).
    None: derived from the checkpoint (`Qwen2_5OmniToken2Wav.load`). Connector options: the
    field names (upstream's `codec_*` keys count 12.5 Hz codec frames; this decoder cuts 50 Hz
    codes into DiT blocks, so they do not apply)."""

    OPTION_KEYS = {name: name for name in ("initial_chunk_blocks", "chunk_blocks", "past_blocks", "future_blocks",
                                           "vocoder_context_frames")}

    # 3 blocks (0.72 s, Qwen's own streaming code): the first chunk plays 0.38 s (the vocoder
    # holds back its context), long enough to cover the next chunk's codes and ODE solve.
    initial_chunk_blocks: int = 3
    chunk_blocks: int = 6
    past_blocks: int | None = None  # None: one per look-back DiT layer (2 released)
    future_blocks: int | None = None  # None: one per look-ahead DiT layer (1 released)
    vocoder_context_frames: int | None = None  # None: BigVGAN's receptive field (34 released)

    def __post_init__(self) -> None:
        ChunkRamp(self.initial_chunk_blocks, self.chunk_blocks)  # validates the sizes
        for name in ("past_blocks", "future_blocks", "vocoder_context_frames"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class StreamGeometry:
    """What a stream needs to know of the model: resolved chunking and the DiT's units."""

    config: Token2WavStreamConfig  # every field set
    block_frames: int  # mel frames per DiT block
    repeats: int  # mel frames per code
    mel_dim: int
    num_embeds: int  # the largest valid code
    settle_codes: int  # codes a chunk waits for past its look-ahead (token2wav_noise.settle_codes)


@dataclass(frozen=True)
class DiTWindow:
    codes: torch.Tensor  # [n_codes]
    noise: torch.Tensor  # [n_codes * repeats, mel_dim]
    keep_from: int  # mel frames of the window's solution that belong to the chunk: [keep_from, keep_to)
    keep_to: int
    last: bool  # the request's final chunk


class Token2WavStream:
    """`stage_io.StreamingDecoder` of one request; `Qwen2_5OmniToken2Wav.decode_streams` runs it.
    Positions are mel frames (2 per code) unless named codes."""

    def __init__(self, request_id: str, speaker: str, num_steps: int, seed: int | None,
                 geometry: StreamGeometry) -> None:
        self.request_id = request_id
        self.speaker = speaker
        self.num_steps = num_steps
        self.geo = geometry
        self._ramp = ChunkRamp(geometry.config.initial_chunk_blocks, geometry.config.chunk_blocks)
        self._codes = RowBuffer(torch.zeros(0, dtype=torch.long))  # indexed by code
        self._noise = StreamNoise(seed, geometry.mel_dim)  # indexed by mel frame
        self._mel = RowBuffer(torch.zeros(0, geometry.mel_dim))  # final mel, not yet vocoded or context
        self._vocoded = 0  # frames whose samples were returned
        self._chunks = 0
        self._final = False
        self.sent_sample_rate = False

    # ------------------------------------------------------------------ StreamingDecoder
    def push(self, units: torch.Tensor, final: bool) -> None:
        """Append codec codes [n] (n may be 0 with `final`), the talker's stop token excluded."""
        if self._final:
            raise ValueError(f"request {self.request_id}: codes pushed after the final push")
        codes = torch.as_tensor(units)
        if codes.dim() != 1 or codes.dtype.is_floating_point:
            raise ValueError(f"request {self.request_id}: expected integer codec codes [n], got "
                             f"{tuple(codes.shape)} {codes.dtype}")
        if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) <= self.geo.num_embeds):
            raise ValueError(f"request {self.request_id}: codec codes must lie in [0, {self.geo.num_embeds}]")
        self._codes.append(codes.to(torch.long).cpu())
        self._final = final

    def ready(self) -> bool:
        if self._mel.end == self._frames:
            return False
        # A chunk that is not the last needs its look-ahead and a code more (`settle_codes`): so
        # the last chunk always has DiT work, and the vocoder's held-back frames go out with it.
        return self._final or self._frames >= self._chunk_end + self._future + self._settle

    @property
    def finished(self) -> bool:
        return self._final and self._vocoded == self._frames

    @property
    def consumed(self) -> int:
        return self._mel.end // self.geo.repeats

    # ------------------------------------------------------------------ used by the model
    def next_dit_window(self) -> DiTWindow:
        """The next chunk's flow-matching window (call only when `ready()`)."""
        if not self.ready():
            raise RuntimeError(f"request {self.request_id}: no chunk is ready to decode")
        start, end = self._mel.end, self._chunk_end
        last = self._frames < end + self._future + self._settle  # only when final: the rest is one chunk
        end = self._frames if last else end
        window_end = end if last else end + self._future
        window_start = max(0, start - self.geo.config.past_blocks * self.geo.block_frames)
        r = self.geo.repeats
        return DiTWindow(codes=self._codes.get(window_start // r, window_end // r),
                         noise=self._noise.rows(window_start, window_end, total=self._frames if last else None),
                         keep_from=start - window_start, keep_to=end - window_start, last=last)

    def vocoder_window(self, window: DiTWindow, mel: torch.Tensor) -> VocoderWindow:
        """What to vocode once the chunk's part of the window's solution (mel [frames, mel_dim])
        is kept: the frames whose samples are final then, all of them after the last chunk, else
        all but the last `context` (their right context is the next chunk's mel). Changes
        nothing (`commit` does, once the audio is made): a failed call can be retried."""
        kept = mel[window.keep_from: window.keep_to]
        context = self.geo.config.vocoder_context_frames
        end = self._mel.end + kept.shape[0]
        emit_to = end if window.last else max(self._vocoded, end - context)
        start = max(0, self._vocoded - context)
        return VocoderWindow(mel=torch.cat([self._mel.get(start, self._mel.end), kept]).T,
                             emit_from=self._vocoded - start, emit_to=emit_to - start, exact_end=window.last)

    def commit(self, window: DiTWindow, vocoded: VocoderWindow) -> None:
        """The chunk's audio was made: keep its mel (the end of `vocoded`'s), forget the codes,
        noise and mel no later window needs."""
        self._mel.append(vocoded.mel.T[vocoded.mel.shape[1] - (window.keep_to - window.keep_from):])
        self._chunks += 1
        next_window_start = self._mel.end - self.geo.config.past_blocks * self.geo.block_frames
        self._codes.drop_before(next_window_start // self.geo.repeats)
        self._noise.drop_before(next_window_start)
        self._vocoded += vocoded.emit_to - vocoded.emit_from
        self._mel.drop_before(self._vocoded - self.geo.config.vocoder_context_frames)

    @property
    def _frames(self) -> int:
        """Mel frames of the codes received so far."""
        return self._codes.end * self.geo.repeats

    @property
    def _future(self) -> int:
        return self.geo.config.future_blocks * self.geo.block_frames

    @property
    def _settle(self) -> int:
        return self.geo.settle_codes * self.geo.repeats

    @property
    def _chunk_end(self) -> int:
        return self._mel.end + self._ramp.size(self._chunks) * self.geo.block_frames
