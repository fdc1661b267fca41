"""The pieces both streaming code2wav models share (models/codec_streaming.py)."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.model_executor.models.codec_streaming import (
    ChunkRamp, Precision, RowBuffer, plan_padded_calls, resolve_precision,
)


def test_chunk_ramp_doubles_up_to_the_steady_size():
    assert [ChunkRamp(4, 25).size(i) for i in range(7)] == [4, 4, 8, 16, 25, 25, 25]
    assert [ChunkRamp(2, 3).size(i) for i in range(4)] == [2, 2, 3, 3]
    assert ChunkRamp(1, 50).size(10_000) == 50
    with pytest.raises(ValueError):
        ChunkRamp(0, 4)


def test_chunk_ramp_with_a_divisor_grows_by_that_fraction_of_all_before():
    assert [ChunkRamp(4, 25, divisor=2).size(i) for i in range(10)] == [4, 2, 3, 5, 7, 11, 16, 24, 25, 25]
    assert [ChunkRamp(1, 25, divisor=3).size(i) for i in range(8)] == [1, 1, 1, 1, 2, 2, 3, 4]
    # divisor 1 is the doubling ramp
    assert all(ChunkRamp(3, 40, 1).size(i) == min(40, 3 << max(0, i - 1)) for i in range(12))
    assert ChunkRamp(1, 25, divisor=4).size(10_000) == 25
    with pytest.raises(ValueError, match="divisor"):
        ChunkRamp(1, 4, divisor=0)


def test_padded_calls_group_rows_of_similar_length():
    # Steady 50-frame windows share a call with a 28-frame one (22 frames of padding < 32);
    # the 12- and 4-frame first chunks get a call of their own rather than 38+ frames of padding.
    assert plan_padded_calls([50, 4, 50, 12, 28], call_cost=32) == [[0, 2, 4], [3, 1]]
    assert plan_padded_calls([5, 900, 30], call_cost=1024) == [[1, 2, 0]]
    assert plan_padded_calls([], call_cost=32) == []


def test_row_buffer_keeps_whole_sequence_indices():
    buf = RowBuffer(torch.zeros(0, 2))
    buf.append(torch.arange(10.0).view(5, 2))
    buf.drop_before(3)
    assert (buf.start, buf.end) == (3, 5) and buf.get(3, 5).tolist() == [[6.0, 7.0], [8.0, 9.0]]
    buf.append(torch.tensor([[10.0, 11.0]]))
    assert buf.get(5, 6).tolist() == [[10.0, 11.0]]
    buf.drop_before(-4)  # before the start: nothing more to drop
    assert buf.start == 3
    with pytest.raises(IndexError):
        buf.get(2, 4)


def test_precision_from_dtype_or_explicit():
    assert resolve_precision("auto", None) is Precision.FLOAT32
    assert resolve_precision("bf16", None) is Precision.BFLOAT16
    assert resolve_precision("float16", None) is Precision.FLOAT32  # never half precision audio
    assert resolve_precision("auto", "tf32") is Precision.TF32
    # On CUDA "auto" computes with TF32; an explicit float32 keeps the reference math there.
    assert resolve_precision("auto", None, "cuda") is Precision.TF32
    assert resolve_precision("float32", None, "cuda") is Precision.FLOAT32
    assert resolve_precision("auto", "float32", "cuda") is Precision.FLOAT32
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("auto", "fp8")
