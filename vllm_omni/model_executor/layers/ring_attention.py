"""Ring attention: each rank's queries meet every rank's K/V block as the blocks go around a ring.

Attention over the union of key blocks equals the log-sum-exp merge of attention over each block:
with o_i, lse_i the output and log-sum-exp of the scores of block i,
    lse = logaddexp(lse_1, ..., lse_n),   o = sum_i exp(lse_i - lse) * o_i.
A rank computes its queries against the block it holds while it passes that block on and receives
the next (overlapping the transfer with the compute); after ring_size - 1 hops every block was
seen once. `prefix` K/V (replicated on every rank, e.g. a prompt's tokens in joint attention) are
attended once, locally. Blocks may differ in length (uneven sequence splits): every rank knows
every block's length, so receive buffers have the right size.

Tensors are heads-first here: q [B, H, Sq, D], k/v [B, H, Sk, D]. Partial outputs are merged in
float32.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (scale 1/sqrt(D), no mask) and the log-sum-exp of each query's scores,
    [B, H, Sq, D] and [B, H, Sq] float32, from a fused kernel where PyTorch has one that returns it."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = scores.logsumexp(-1)
        out = (torch.softmax(scores, -1) @ v.float()).to(q.dtype)
    return out, lse[..., :q.shape[2]].float()  # the efficient kernel pads lse's length to a multiple of 32


class _Partial:
    """A running (output, log-sum-exp) pair, merged one key block at a time."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        out = out.float()
        if self.out is None:
            self.out, self.lse = out, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        self.out = self.out * torch.exp(self.lse - merged).unsqueeze(-1) + out * torch.exp(lse - merged).unsqueeze(-1)
        self.lse = merged


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                   ranks: Sequence[int], index: int, block_lengths: Sequence[int],
                   prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`q` against the K/V blocks of all ring ranks (and `prefix`), [B, H, Sq, D] in q's dtype.

    ranks: the global ranks of the ring in ring order; index: this rank's place in it;
    block_lengths[i]: the key length of ring rank i's block (this rank's is k.shape[2])."""
    size = len(ranks)
    partial = _Partial()
    if prefix is not None and prefix[0].shape[2]:
        partial.add(*attention_with_lse(q, *prefix))
    kv = torch.stack([k, v]).contiguous()
    for hop in range(size):
        pending = None
        if hop < size - 1:  # pass the block on while attending to it
            incoming = (index - hop - 1) % size
            buffer = kv.new_empty((2, *k.shape[:2], block_lengths[incoming], k.shape[3]))
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, ranks[(index + 1) % size], group),
                                              dist.P2POp(dist.irecv, buffer, ranks[(index - 1) % size], group)])
        partial.add(*attention_with_lse(q, kv[0], kv[1]))
        if pending is not None:
            for work in pending:
                work.wait()
            kv = buffer
    return partial.out.to(q.dtype)
