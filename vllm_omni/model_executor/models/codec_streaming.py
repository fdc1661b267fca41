"""What the two streaming codec decoders share (Qwen3-Omni code2wav, Qwen2.5-Omni token2wav).

- `ChunkRamp`: the chunk sizes of a stream: a small first chunk (first audio early), each next
  one as long as all before it, up to a steady size (fewer, larger decode calls once audio flows).
- `RowBuffer`: the part of a growing sequence a stream still needs, by whole-sequence index.
- `plan_padded_calls`: which rows of different lengths share one right-padded forward call.
- `Precision` and `precision_scope`: float32 / TF32 / bfloat16 execution of a decoder.
- `own_streams`, `chunk_output`: what both models' `decode_streams` do with their streams.
- `CausalConvLayer`, `TransConvLayer`, `context_frames`: how many frames of left context a
  causal convolution stack (the Qwen3 decoders' vocoders) reads, walked layer by layer.

docs/streaming.md explains the choices.
"""
from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from vllm_omni.model_executor.dtypes import canonical_dtype
from vllm_omni.stage_io import StageRequest

S = TypeVar("S")


@dataclass(frozen=True)
class ChunkRamp:
    """Chunk sizes in units (codec frames, DiT blocks): `initial`, then each chunk as long as all
    before it (initial, initial, 2 initial, 4 initial, ...) up to `steady`; with `divisor` d, each
    chunk is all before it over d, rounded up (d = 2, initial 4: 4, 2, 3, 5, 7, 11, ...).

    A chunk is made while the chunks before it play: a producer faster than d / (d + 1) of real
    time keeps playback fed (half real time for d = 1), with margin at the first joins
    (docs/streaming.md). A larger d tolerates a slower producer for more, shorter chunks during
    the ramp (each decodes its left context again). Doubling from the first chunk (initial,
    2 initial, ...) asks twice as many units at the first join, with none."""

    initial: int
    steady: int
    divisor: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.initial <= self.steady:
            raise ValueError(f"chunk sizes need 1 <= initial ({self.initial}) <= steady ({self.steady})")
        if self.divisor < 1:
            raise ValueError(f"the ramp's divisor must be >= 1, got {self.divisor}")

    def size(self, index: int) -> int:
        """The size of chunk `index` (0 = the first)."""
        size = before = self.initial
        for _ in range(index):  # ends at the steady size: each chunk adds >= 1 unit to `before`
            size = min(self.steady, -(-before // self.divisor))
            if size == self.steady:
                break
            before += size
        return size


class RowBuffer:
    """Rows [start, end) of a sequence that grows along dim 0, addressed by their index in the
    whole sequence; rows before `start` were dropped (a stream keeps only what it still needs)."""

    def __init__(self, empty: torch.Tensor) -> None:
        self.rows = empty
        self.start = 0

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]

    def append(self, rows: torch.Tensor) -> None:
        self.rows = torch.cat([self.rows, rows])

    def get(self, begin: int, stop: int) -> torch.Tensor:
        if not self.start <= begin <= stop <= self.end:
            raise IndexError(f"rows [{begin}, {stop}) outside the kept [{self.start}, {self.end})")
        return self.rows[begin - self.start: stop - self.start]

    def drop_before(self, index: int) -> None:
        index = min(max(index, self.start), self.end)
        self.rows = self.rows[index - self.start:]
        self.start = index


@dataclass(frozen=True)
class CausalConvLayer:
    """A convolution padded `left_pad` samples on the left (span - stride for a causal one):
    output j reads inputs from j * stride - left_pad on."""

    stride: int
    left_pad: int


@dataclass(frozen=True)
class TransConvLayer:
    """A transposed convolution whose first `left_trim` outputs are dropped: output u is raw
    output u + left_trim, which reads the inputs i with i * stride <= u + left_trim < i * stride + kernel."""

    kernel: int
    stride: int
    left_trim: int = 0


def context_frames(layers: Sequence[CausalConvLayer | TransConvLayer], input_per_frame: int,
                   output_reach: int = 0) -> int:
    """Frames of input a causal convolution stack reads before a frame boundary, for its outputs
    from `output_reach` samples before that boundary on (the wanted samples' start).

    `layers` in the order they run, convolutions only (activations and residual skips add no
    reach; a residual unit is its branch's convolutions). Walks back from the output: `reach`
    counts the samples before the boundary (aligned, at each layer, with the input frames)
    that the wanted outputs read."""
    reach = output_reach
    for layer in reversed(layers):
        if isinstance(layer, CausalConvLayer):  # output B - R reads from (B - R) * s - left_pad
            reach = reach * layer.stride + layer.left_pad
        else:  # output B*s - R reads from ceil((B*s - R + left_trim - kernel + 1) / s)
            reach = -(-(reach + layer.kernel - layer.left_trim) // layer.stride) - 1
    return math.ceil(reach / input_per_frame)


def plan_padded_calls(lengths: Sequence[int], call_cost: int) -> list[list[int]]:
    """Group rows (by index) into right-padded forward calls, longest first.

    A row joins the current call when the padding it adds (the call's length minus its own)
    costs less than a call of its own, `call_cost` units of length (launch overhead); else it
    opens the next call. So a batch of similar lengths is one call and a 4-frame first chunk
    is not padded to a 50-frame window.
    """
    calls: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if calls and lengths[calls[-1][0]] - lengths[row] < call_cost:
            calls[-1].append(row)
        else:
            calls.append([row])
    return calls


class Precision(str, enum.Enum):
    """How a codec decoder computes. FLOAT32 is the reference (TF32 off for matmuls and convs);
    TF32 keeps float32 weights with TF32 tensor-core math (CUDA only); BFLOAT16 runs the heavy
    network in bfloat16. tests/gpu/test_code2wav_precision.py holds the waveform tolerances."""

    FLOAT32 = "float32"
    TF32 = "tf32"
    BFLOAT16 = "bfloat16"

    def scope(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The math switches of a decoder that runs wholly in this precision (TF32 on for TF32 only)."""
        return precision_scope(device, tf32=self is Precision.TF32)


def resolve_precision(dtype: str, precision: str | None, device: torch.device | str = "cpu",
                      cuda_auto: Precision = Precision.TF32) -> Precision:
    """The precision a stage asked for: an explicit `precision`, else from its dtype: bfloat16 ->
    BFLOAT16; "auto" -> the model's `cuda_auto` on CUDA (TF32 unless the model says otherwise:
    float32 weights on tensor cores, 2-4x faster than the float32 units, within the SNR floors of
    tests/gpu/test_code2wav_precision.py) and FLOAT32 elsewhere; anything else, float16 included,
    -> FLOAT32 (a pipeline-wide float16 must not push audio through half precision, where the
    vocoders overflow; `dtype: float32` asks for the reference math on the GPU too)."""
    if precision is None:
        dtype = canonical_dtype(dtype)
        if dtype == "bfloat16":
            return Precision.BFLOAT16
        return cuda_auto if dtype == "auto" and torch.device(device).type == "cuda" else Precision.FLOAT32
    try:
        return Precision(precision)
    except ValueError:
        raise ValueError(f"unknown precision {precision!r}; expected one of {[p.value for p in Precision]}") from None


@contextlib.contextmanager
def precision_scope(device: torch.device, tf32: bool) -> Iterator[None]:
    """TF32 on (or off) for CUDA matmuls and convolutions within the block, then restored.

    PyTorch's own defaults differ (convs TF32, matmuls not); FLOAT32 turns both off. The
    switches are process-wide: a stage that shares its process with another stage thread
    changes them for that thread too while the block runs.
    """
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def own_streams(decoders: Sequence[object], stream_type: type[S]) -> list[S]:
    """The decoders, checked to be streams this model opened."""
    for decoder in decoders:
        if not isinstance(decoder, stream_type):
            raise TypeError(f"decode_streams got a {type(decoder).__name__}, not a {stream_type.__name__} "
                            "opened by this model")
    return list(decoders)


def prompt_frames(req: StageRequest, num_quantizers: int, codebook_size: int) -> torch.Tensor:
    """[num_quantizers, frames] from a code2wav request's codebook-major flat prompt (the
    talker2code2wav bridges' layout), checked."""
    flat = torch.tensor(req.prompt_token_ids, dtype=torch.long)
    if flat.numel() % num_quantizers:
        raise ValueError(f"request {req.request_id}: {flat.numel()} codes are not a whole number of frames of "
                         f"{num_quantizers} codebooks")
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < codebook_size):
        raise ValueError(f"request {req.request_id}: codec codes must lie in [0, {codebook_size})")
    return flat.view(num_quantizers, -1)


def chunk_output(stream, audio: torch.Tensor, sample_rate: int) -> dict[str, torch.Tensor]:
    """One chunk's output; the first chunk of a stream also carries the 0-dim sample rate."""
    out = {"audio": audio}
    if not stream.sent_sample_rate:
        out["sample_rate"] = torch.tensor(sample_rate, dtype=torch.int32)
        stream.sent_sample_rate = True
    return out
