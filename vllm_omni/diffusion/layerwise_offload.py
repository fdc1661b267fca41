"""Layerwise (blockwise) offload of a diffusion transformer (`enable_layerwise_offload`).

The transformer's blocks run in order, once each per denoiser forward. With offload, every block
but the first keeps its weights in one CPU buffer (pinned on CUDA, so copies run asynchronously)
and the device holds a ring of two block-sized buffers: block j's parameters are views into slot
j % 2, filled just before it runs. Before block j runs, the next block is copied into the other
slot on a side stream while block j computes; events make the compute stream wait for its own
block's copy only, and each copy wait until the block that used its slot has finished computing.
The device memory of the blocks is two blocks' instead of all of them.

The first block stays on the device: a cache (TeaCache) reads its modulation layers outside the
blocks' forward, and it runs while the first offloaded block is copied in.

On the CPU the same hooks run with CPU buffers and synchronous copies: the outputs equal those
without offload (the weights are the same bytes), which the tests check together with the order
of the copies.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

_ALIGN = 256  # bytes: every tensor of a block starts aligned in its slot (any dtype's views, coalesced copies)


@dataclass
class _Block:
    module: nn.Module
    host: torch.Tensor  # uint8 [nbytes]: the block's weights, in CPU memory
    tensors: list[tuple[torch.Tensor, int]]  # (parameter or buffer, byte offset in the block's layout)


class LayerwiseOffload:
    """Installed by `install`; lives as long as the hooks on the blocks."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.blocks = [_take_to_host(block, pin=self.cuda) for block in blocks]
        slot_bytes = max((b.host.numel() for b in self.blocks), default=0)
        self.ring = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.holder: list[int | None] = [None, None]  # the block each slot holds
        self.copies = 0  # blocks copied in since installation
        self.trace: list[tuple[str, int]] | None = None  # ("copy" | "run", block): set a list to record
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.loaded = [torch.cuda.Event(), torch.cuda.Event()]  # the slot's copy is done
            self.freed = [torch.cuda.Event(), torch.cuda.Event()]  # its last block has finished computing
        for j, block in enumerate(self.blocks):
            _point_into(block, self.ring[j % 2])

    @classmethod
    def install(cls, blocks: Sequence[nn.Module], device: torch.device) -> LayerwiseOffload:
        """Offload blocks[1:] (modules with their weights, e.g. on the CPU after loading) and hook
        every block; the caller moves the rest of the transformer to the device afterwards."""
        offload = cls(blocks[1:], torch.device(device))
        blocks[0].register_forward_pre_hook(lambda module, args: offload._prefetch(0))
        for j, block in enumerate(blocks[1:]):
            block.register_forward_pre_hook(lambda module, args, j=j: offload._before(j))
            block.register_forward_hook(lambda module, args, output, j=j: offload._after(j))
        if offload.cuda:
            torch.cuda.empty_cache()  # the blocks' device copies, if they were loaded there
        logger.info("layerwise offload: %d of %d blocks in CPU memory (%.1f MiB), a ring of 2 x %.1f MiB on %s",
                    len(offload.blocks), len(blocks), sum(b.host.numel() for b in offload.blocks) / 2**20,
                    offload.ring[0].numel() / 2**20, device)
        return offload

    # --- hooks ----------------------------------------------------------------------------
    def _before(self, j: int) -> None:
        slot = j % 2
        if self.holder[slot] != j:  # not prefetched (out of order): copy it now
            self._prefetch(j)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[slot])
        if self.trace is not None:
            self.trace.append(("run", j))
        nxt = (j + 1) % len(self.blocks)
        if nxt % 2 != slot:  # the other slot: its block finished before this one started
            self._prefetch(nxt)

    def _after(self, j: int) -> None:
        if self.cuda:
            self.freed[j % 2].record(torch.cuda.current_stream(self.device))

    def _prefetch(self, j: int) -> None:
        if not self.blocks:
            return
        slot = j % 2
        if self.holder[slot] == j:
            return
        block = self.blocks[j]
        target = self.ring[slot][:block.host.numel()]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.freed[slot])
                target.copy_(block.host, non_blocking=True)
                self.loaded[slot].record(self.stream)
        else:
            target.copy_(block.host)
        self.holder[slot] = j
        self.copies += 1
        if self.trace is not None:
            self.trace.append(("copy", j))


def _take_to_host(module: nn.Module, pin: bool) -> _Block:
    """The module's parameters and buffers, packed into one CPU buffer (aligned offsets)."""
    seen: set[int] = set()
    tensors: list[tuple[torch.Tensor, int]] = []
    size = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        tensors.append((t, size))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    for t, offset in tensors:
        _view(host, t, offset).copy_(t.data)
    return _Block(module, host, tensors)


def _point_into(block: _Block, slot: torch.Tensor) -> None:
    """Make the block's tensors views of its slot (their old storage is released)."""
    for t, offset in block.tensors:
        t.data = _view(slot, t, offset)


def _view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return flat[offset:offset + nbytes].view(like.dtype).view(like.shape)
