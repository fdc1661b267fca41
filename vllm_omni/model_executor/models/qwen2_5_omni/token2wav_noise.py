"""The start noise of Qwen2.5-Omni token2wav's flow matching: transformers' one draw
`torch.randn(frames, mel_dim)` after seeding, from each request's own generator, whole or as a
stream needs it.

torch's CPU `randn` (float32, 16 values or more) turns uniforms into normals in groups of 16
(Box-Muller over 16 uniforms), then, when the size is not a multiple of 16, redraws the last
16 values from 16 fresh uniforms; under 16 values it draws them one by one. So draws of whole
groups continue one another exactly, and only a request's last 16 values depend on its length.
A stream draws whole groups as its windows need them, never reads the last 16 values before
it knows the length (`settle_codes`), and its last window redraws them (`StreamNoise.rows`).
tests/models/test_qwen2_5_omni_token2wav_configs.py checks both paths against transformers.
"""
from __future__ import annotations

import torch

from vllm_omni.model_executor.models.codec_streaming import RowBuffer

RANDN_GROUP = 16  # see the module docstring


def new_generator(seed: int | None) -> torch.Generator:
    """A request's noise generator, on the CPU whatever the device (so that a seed means the
    same audio on every device and streamed noise can be drawn in pieces)."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # unseeded request: fresh entropy, like vLLM's unseeded sampling
    else:
        gen.manual_seed(seed)
    return gen


def whole_noise(gen: torch.Generator, frames: int, mel_dim: int) -> torch.Tensor:
    """A whole request's noise [frames, mel_dim]: transformers' draw."""
    return torch.randn(frames, mel_dim, generator=gen, dtype=torch.float32)


def settle_codes(repeats: int, mel_dim: int) -> int:
    """Codes a stream must have past a window before that window is not the request's last:
    then the window reads none of the last `RANDN_GROUP` noise values, whatever the length
    turns out to be (one code for the released model: 160 values)."""
    return -(-RANDN_GROUP // (repeats * mel_dim))


class StreamNoise:
    """One stream's noise rows: those of `whole_noise` for the request's final length."""

    def __init__(self, seed: int | None, mel_dim: int) -> None:
        self._generator = new_generator(seed)
        self._seed = self._generator.initial_seed()  # an unseeded request's too: its tail is redrawn
        self._mel_dim = mel_dim
        self._values = RowBuffer(torch.zeros(0))  # drawn in whole groups, indexed by value

    def rows(self, start: int, end: int, total: int | None = None) -> torch.Tensor:
        """Rows [start, end) [end - start, mel_dim]. `total`: the request's length in rows, once
        known; without it the rows must lie before the last `RANDN_GROUP` values (`settle_codes`)."""
        lo, hi = start * self._mel_dim, end * self._mel_dim
        n = None if total is None else total * self._mel_dim
        if n is not None and (n % RANDN_GROUP or n < RANDN_GROUP) and hi > n - RANDN_GROUP:
            # Its last values were redrawn: redo the request's one draw (once, for its last window).
            return whole_noise(new_generator(self._seed), total, self._mel_dim)[start:end]
        if self._values.end < hi:
            groups = -(-(hi - self._values.end) // RANDN_GROUP)
            self._values.append(torch.randn(groups * RANDN_GROUP, generator=self._generator, dtype=torch.float32))
        return self._values.get(lo, hi).reshape(end - start, self._mel_dim)

    def drop_before(self, row: int) -> None:
        """Forget rows before `row` (no later window reads them)."""
        self._values.drop_before(row * self._mel_dim)
