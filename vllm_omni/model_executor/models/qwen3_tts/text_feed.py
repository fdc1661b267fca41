"""The text rows a talker request's frames read: output token k's input row adds `row(k)`.

qwen-tts feeds the text one token per frame after the prompt ("trailing" text), then tts_eos,
then tts_pad for as long as the talker speaks. A request whose whole text is known reads
trailing[k] at frame k. A request whose text streams in (the speech socket) gets its text in
chunks: frame k reads the next unread token if one has arrived. When none has, the talker
either waits for text (`max_frames_per_token` 0: the layout of the whole text exactly, as long
as the text stays ahead), or goes on speaking what it has read with tts_pad rows until it has
made `max_frames_per_token` frames per text token read (speech runs ~3-4 frames per token:
the talker reads ahead of what it says), then waits. tts_eos comes with the last chunk.

Each frame's choice is made once and kept (a preempted request recomputes the same rows).
"""
from __future__ import annotations

import math

import torch

_PAD = -1  # a frame that read tts_pad


class TextFeed:
    def __init__(self, trailing: torch.Tensor, pad: torch.Tensor, complete: bool, text_read: int,
                 max_frames_per_token: float = 0.0) -> None:
        """trailing: [T, H] text rows after the prompt; text_read: text tokens inside the prompt."""
        self.text = trailing
        self.pad = pad
        self.complete = complete
        self.streamed = not complete  # complete from the start: frame k reads trailing[k]
        self.max_frames_per_token = max_frames_per_token
        self.tokens_read = text_read
        self.choices: list[int] = []  # streamed: text row read by frame k, or _PAD
        self.next_row = 0  # streamed: the first text row no frame has read

    def append(self, rows: torch.Tensor, final: bool, eos: torch.Tensor) -> None:
        """More text rows [n, H]; `final`: the text ends here (tts_eos follows)."""
        if self.complete:
            raise ValueError("the request's text is already complete")
        parts = [self.text, rows] + ([eos[None]] if final else [])
        self.text = torch.cat(parts) if len(parts) > 1 else self.text
        self.complete = final

    def row(self, k: int) -> torch.Tensor:
        """[H] the text row frame k reads (decides it, and those before it, if not yet)."""
        if not self.streamed:
            return self.text[k] if k < self.text.shape[0] else self.pad
        while len(self.choices) <= k:
            self._decide()
        i = self.choices[k]
        return self.pad if i == _PAD else self.text[i]

    def can_read(self, k: int) -> bool:
        """Frame k's row can be chosen now."""
        frames = self.decidable()
        return frames is None or k < frames

    def decidable(self) -> int | None:
        """How many frames' rows can be chosen now (None: all)."""
        if self.complete:
            return None
        unread = self.text.shape[0] - self.next_row
        return max(len(self.choices) + unread, math.floor(self.max_frames_per_token * (self.tokens_read + unread)))

    def _decide(self) -> None:
        k = len(self.choices)
        if self.next_row < self.text.shape[0]:
            self.choices.append(self.next_row)
            self.next_row += 1
            self.tokens_read += 1
        elif self.complete or k < math.floor(self.max_frames_per_token * self.tokens_read):
            self.choices.append(_PAD)
        else:  # the engine computes only positions below available_positions
            raise RuntimeError(f"frame {k}'s text has not arrived")
