"""A tensor that grows along dim 0 in amortized O(rows appended): accumulating a stream.

Streams accumulate rows one small chunk at a time (a hidden-state row per decode step, a codec
frame, a few hundred audio samples). `torch.cat` on every chunk copies everything so far each
time (quadratic in the stream's length); this keeps a buffer with spare capacity, doubled when
full, and hands out views of the filled part. A view stays valid after later appends: rows once
written never change, and a reallocation leaves old views on the old storage.
"""
from __future__ import annotations

import torch


class GrowingTensor:
    def __init__(self, first: torch.Tensor) -> None:
        if first.dim() == 0:
            raise ValueError("a GrowingTensor holds rows; got a 0-dim tensor")
        self._buffer = first.clone()
        self._rows = first.shape[0]

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Add rows [n, *shape]; returns the view of all rows so far."""
        if rows.shape[1:] != self._buffer.shape[1:] or rows.dtype != self._buffer.dtype:
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} do not extend "
                             f"{tuple(self._buffer.shape)} {self._buffer.dtype}")
        needed = self._rows + rows.shape[0]
        if needed > self._buffer.shape[0]:
            grown = self._buffer.new_empty((max(needed, 2 * self._buffer.shape[0]), *self._buffer.shape[1:]))
            grown[: self._rows] = self._buffer[: self._rows]
            self._buffer = grown
        self._buffer[self._rows : needed] = rows.to(self._buffer.device)
        self._rows = needed
        return self.view

    @property
    def view(self) -> torch.Tensor:
        return self._buffer[: self._rows]

    def __len__(self) -> int:
        return self._rows
