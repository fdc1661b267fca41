"""Sequence parallelism for diffusion transformers: Ulysses, ring, and both (USP).

A transformer's token-wise parts (projections, norms, MLPs, modulation) run on each rank's own
slice of the sequence; only attention needs the other ranks' tokens. `SequenceParallelAttention`
takes this rank's q/k/v slices, [B, S_local, H, D], and returns its slice of the output:

- Ulysses (`ulysses_degree`): an all-to-all turns "my tokens, all heads" into "all tokens of my
  Ulysses group, my share of the heads"; attention runs locally; a second all-to-all turns it back.
- Ring (`ring_degree`): K/V blocks go around the ring and partial outputs are merged by their
  log-sum-exp (ring_attention.py).
- Both: Ulysses inside a group of neighbouring ranks, ring across the groups (a 2-D grid).

`joint` q/k/v are tokens every rank holds in full (Qwen-Image's prompt tokens, attended jointly
with the image): each Ulysses rank takes its heads of them, they join the keys once (the ring's
local prefix), and their output is gathered back to all heads, so every rank returns them whole.
Cross-attention to replicated text needs no wrapper: the queries are the rank's own tokens.

Modes (`ulysses_mode`): 'strict' needs the head count divisible by the Ulysses degree and the
sequence by the whole degree (checked at startup and per request, with the reason);
'advanced_uaa' pads heads with zeros (their outputs are dropped) and splits an uneven sequence
into slices that differ by at most one token (all-to-all with unequal splits, ring blocks of
unequal length).

Usage, e.g. in a model's attention processor (Wan2.2's self-attention over video tokens):

    plan = group.plan(seq_len)              # once per forward: who holds which tokens
    x = plan.local(x, dim=1)                # this rank's tokens (and of its RoPE table, dim=0)
    ...
    out = sp_attention(q, k, v, plan)       # instead of scaled_dot_product_attention
    ...
    x = plan.gather(x, dim=1)               # every rank gets the whole sequence back
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vllm_omni.model_executor.layers.ring_attention import ring_attention

Joint = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def even_split(total: int, parts: int) -> list[int]:
    """`total` into `parts` lengths that differ by at most one, the longer ones first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True, eq=False)
class SequenceParallelGroup:
    """This rank's place in a (ring x Ulysses) grid; size-1 dimensions have no process group."""

    ulysses_size: int
    ulysses_rank: int
    ulysses_group: dist.ProcessGroup | None
    ring_size: int
    ring_rank: int
    ring_group: dist.ProcessGroup | None
    ring_ranks: tuple[int, ...]  # global ranks of this rank's ring, in ring order
    group: dist.ProcessGroup  # all ranks of the grid, in sequence order (ring rank, then Ulysses rank)
    mode: str = "strict"

    @property
    def size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def check_heads(self, num_heads: int) -> None:
        """Startup check of a model's head count (ValueError with the reason)."""
        if self.mode == "strict" and num_heads % self.ulysses_size:
            raise ValueError(f"ulysses_mode 'strict' needs the attention head count ({num_heads}) divisible by "
                             f"ulysses_degree={self.ulysses_size}; choose a degree in "
                             f"{[d for d in range(1, num_heads + 1) if num_heads % d == 0]} or ulysses_mode "
                             "'advanced_uaa' (heads padded)")

    def check_length(self, seq_len: int) -> None:
        """ValueError when this sequence cannot be split (a request that fails alone)."""
        if seq_len < self.size:
            raise ValueError(f"a sequence of {seq_len} tokens is shorter than the sequence-parallel degree "
                             f"{self.size}: every rank needs at least one token")
        if self.mode == "strict" and seq_len % self.size:
            raise ValueError(f"ulysses_mode 'strict' needs the sequence length ({seq_len} tokens) divisible by "
                             f"ulysses_degree x ring_degree = {self.size}; choose a size whose token count is, or "
                             "ulysses_mode 'advanced_uaa' (uneven splits)")

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `x` over the grid's ranks (e.g. FP8 scales' absmax over
        every rank's tokens)."""
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def plan(self, seq_len: int) -> SequencePlan:
        """The split of a sequence: ring chunks first, each cut among its Ulysses group."""
        self.check_length(seq_len)
        lengths = [n for chunk in even_split(seq_len, self.ring_size) for n in even_split(chunk, self.ulysses_size)]
        return SequencePlan(self, tuple(lengths))


@dataclass(frozen=True)
class SequencePlan:
    group: SequenceParallelGroup
    lengths: tuple[int, ...]  # tokens held by each rank of the grid, in sequence order

    @property
    def offset(self) -> int:
        return sum(self.lengths[:self.group.rank])

    @property
    def ulysses_lengths(self) -> tuple[int, ...]:
        """The lengths held by the ranks of this rank's Ulysses group."""
        g = self.group
        return self.lengths[g.ring_rank * g.ulysses_size:(g.ring_rank + 1) * g.ulysses_size]

    @property
    def ring_block_lengths(self) -> tuple[int, ...]:
        """After the Ulysses all-to-all, the tokens of each ring rank's block."""
        u = self.group.ulysses_size
        return tuple(sum(self.lengths[r * u:(r + 1) * u]) for r in range(self.group.ring_size))

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor."""
        return x.narrow(dim, self.offset, self.lengths[self.group.rank])

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's slice, concatenated in sequence order (on every rank)."""
        longest = max(self.lengths)
        x = x.movedim(dim, 0)
        padded = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))]).contiguous()
        parts = [torch.empty_like(padded) for _ in self.lengths]
        dist.all_gather(parts, padded, group=self.group.group)
        return torch.cat([p[:n] for p, n in zip(parts, self.lengths)]).movedim(0, dim)


class SequenceParallelAttention:
    """Attention over the whole sequence from each rank's slice: [B, S_local, H, D] in and out."""

    def __init__(self, group: SequenceParallelGroup) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SequencePlan,
                 joint: Joint | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This rank's output slice; with `joint`, also the joint tokens' output (whole, every rank)."""
        g = self.group
        heads = q.shape[2]
        padded_heads = -(-heads // g.ulysses_size) * g.ulysses_size
        lengths = plan.ulysses_lengths
        q, k, v = (self._scatter_heads(_pad_heads(x, padded_heads), lengths) for x in (q, k, v))
        if joint is not None:
            joint = tuple(self._my_heads(_pad_heads(x, padded_heads)) for x in joint)
        out, joint_out = self._attend(q, k, v, joint, plan)
        out = self._gather_heads(out, lengths)[:, :, :heads]
        if joint is None:
            return out
        return out, self._all_heads(joint_out)[:, :, :heads]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: Joint | None,
                plan: SequencePlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of [image, joint] queries over every key, [B, S, h, D] layouts in and out."""
        g = self.group
        n = q.shape[1]
        if joint is not None:
            q = torch.cat([q, joint[0]], dim=1)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        prefix = None if joint is None else (joint[1].transpose(1, 2), joint[2].transpose(1, 2))
        if g.ring_size > 1:
            out = ring_attention(q, k, v, group=g.ring_group, ranks=g.ring_ranks, index=g.ring_rank,
                                 block_lengths=plan.ring_block_lengths, prefix=prefix)
        elif prefix is not None:
            out = F.scaled_dot_product_attention(q, torch.cat([k, prefix[0]], 2), torch.cat([v, prefix[1]], 2))
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2)
        return out[:, :n], (out[:, n:] if joint is not None else None)

    def _scatter_heads(self, x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """[B, S_mine, H, D] -> [B, S_group, H / U, D]: my tokens' heads to their owners."""
        g = self.group
        if g.ulysses_size == 1:
            return x
        b, s, h, d = x.shape
        # Row block j of the send buffer (my tokens, head share j) goes to Ulysses rank j.
        send = x.reshape(b, s, g.ulysses_size, h // g.ulysses_size, d).permute(2, 1, 0, 3, 4).contiguous()
        recv = x.new_empty((sum(lengths), b, h // g.ulysses_size, d))
        dist.all_to_all_single(recv, send.flatten(0, 1), output_split_sizes=list(lengths),
                               input_split_sizes=[s] * g.ulysses_size, group=g.ulysses_group)
        return recv.permute(1, 0, 2, 3)

    def _gather_heads(self, x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """The inverse: [B, S_group, H / U, D] -> [B, S_mine, H, D]."""
        g = self.group
        if g.ulysses_size == 1:
            return x
        b, _, h, d = x.shape
        mine = lengths[g.ulysses_rank]
        recv = x.new_empty((g.ulysses_size * mine, b, h, d))
        dist.all_to_all_single(recv, x.permute(1, 0, 2, 3).contiguous(), output_split_sizes=[mine] * g.ulysses_size,
                               input_split_sizes=list(lengths), group=g.ulysses_group)
        return recv.reshape(g.ulysses_size, mine, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, mine, -1, d)

    def _my_heads(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        share = x.shape[2] // g.ulysses_size
        return x[:, :, g.ulysses_rank * share:(g.ulysses_rank + 1) * share]

    def _all_heads(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if g.ulysses_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(g.ulysses_size)]
        dist.all_gather(parts, x, group=g.ulysses_group)
        return torch.cat(parts, dim=2)


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Zero heads up to `heads` (advanced_uaa): a zero query, key and value head attends to
    nothing real and its output is dropped."""
    return x if x.shape[2] == heads else F.pad(x, (0, 0, 0, heads - x.shape[2]))
