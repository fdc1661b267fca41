"""Helpers of the streaming code2wav tests (both families): drive a stream, measure audio."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest


def open_empty(model, rid: str = "r", seed: int | None = None, **info) -> object:
    """A stream whose units all arrive by push (the request carries no codes)."""
    return model.open_stream(StageRequest(request_id=rid, prompt_token_ids=[], additional_information=info,
                                          sampling_params=SamplingParams(seed=seed)))


def run_stream(model, stream, units: torch.Tensor, pieces: Sequence[int] | None = None) -> list[dict]:
    """Push `units` in pieces of these sizes (all at once if None), decoding whenever the
    stream is ready, alone in its batch; returns every chunk's output."""
    pieces = [len(units)] if pieces is None else list(pieces)
    assert sum(pieces) == len(units)
    outputs, at = [], 0
    for n in pieces:
        at += n
        stream.push(units[at - n: at], final=at == len(units))
        while stream.ready():
            outputs.extend(model.decode_streams([stream]))
    assert stream.finished and not stream.ready()
    return outputs


def audio_of(outputs: list[dict]) -> list[torch.Tensor]:
    """Each chunk's audio on the host (decode_streams may leave it on the device)."""
    return [out["audio"].cpu() for out in outputs]


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (other - reference).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum().item() / noise)


def join_and_inner_jumps(chunks: list[torch.Tensor]) -> tuple[float, float]:
    """(largest |x[t+1] - x[t]| across a chunk join, largest inside the chunks)."""
    joined = torch.cat(chunks)
    jumps = joined.diff().abs()
    joins = torch.tensor([c.numel() for c in chunks if c.numel()]).cumsum(0)[:-1] - 1
    inner = jumps.clone()
    inner[joins] = 0
    return jumps[joins].max().item(), inner.max().item()
