"""A cloned voice's encodings, kept by the content of its reference audio.

Cloning a voice runs two encoders over the reference waveform before the request's first step:
the speaker encoder (its talker row) and, for in-context cloning, Mimi's encoder (its codes):
~4 ms replayed from their graphs on the H200 (reference_graphs.py), ~20 ms eagerly. A service
clones the same few voices again and again (qwen-tts offers the same reuse as
`create_voice_clone_prompt`), so requests whose reference has the same samples share one
encoding: the talker computes each part on its first use and keeps the most recent references.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

CAPACITY = 64  # references kept; an entry is a talker row and the codes, a few kB on the device


@dataclass
class ReferenceEncoding:
    speaker: torch.Tensor  # [hidden] the speaker encoder's row
    codes: torch.Tensor | None = None  # [frames, groups] Mimi's codes, once an in-context request asked


class ReferenceCache:
    """LRU of `ReferenceEncoding` by the reference waveform's bytes (and shape)."""

    def __init__(self, embed_speaker: Callable[[torch.Tensor], torch.Tensor],
                 encode_codes: Callable[[torch.Tensor], torch.Tensor], capacity: int = CAPACITY) -> None:
        self._embed_speaker = embed_speaker
        self._encode_codes = encode_codes
        self._capacity = capacity
        self._entries: OrderedDict[bytes, ReferenceEncoding] = OrderedDict()

    def encode(self, audio: torch.Tensor, with_codes: bool) -> ReferenceEncoding:
        key = _content_key(audio)
        entry = self._entries.get(key)
        if entry is None:
            entry = ReferenceEncoding(self._embed_speaker(audio))
            self._entries[key] = entry
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if with_codes and entry.codes is None:
            entry.codes = self._encode_codes(audio)
        return entry

    def __len__(self) -> int:
        return len(self._entries)


def _content_key(audio: torch.Tensor) -> bytes:
    samples = audio.detach().cpu().contiguous()
    digest = hashlib.blake2b(samples.view(torch.uint8).numpy().tobytes(), digest_size=16)
    digest.update(f"{samples.dtype}{tuple(samples.shape)}".encode())
    return digest.digest()
