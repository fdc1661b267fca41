"""Tensor-parallel groups: which rank this process is, and the collectives sharded layers call.

A `TPGroup` is an explicit object, not process-global state: layers pick up the group that is
current while they are built (`with building_with(group): model = cls(config)`) and keep it,
so several engines (TP=1 and TP=2, or two stages run as threads) can live in one process.
Process groups are created directly (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA)
over a TCPStore that rank 0 hosts on loopback, without `torch.distributed.init_process_group`.

With size 1 every collective is the identity and no process group exists: TP=1 runs exactly
the single-process code.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"  # the ranks of one stage share a host


@dataclass(frozen=True, eq=False)
class TPGroup:
    rank: int = 0
    size: int = 1
    pg: object | None = None  # ProcessGroupGloo / ProcessGroupNCCL; None when size == 1
    device: torch.device = torch.device("cpu")  # where this rank's collective buffers live

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (x must be contiguous); returned for chaining."""
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest `value` any rank holds (e.g. the KV blocks every rank can afford)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0: every rank's `x` concatenated along `dim` in rank order. Other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=dim)
        self.pg.gather([], [x], opts).wait()
        return None

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total` items; `total` must divide evenly."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what}={total}")
        size = total // self.size
        return self.rank * size, size

    def abort(self) -> None:
        """Make collectives blocked on a dead peer fail (NCCL; gloo notices closed sockets itself)."""
        if self.pg is not None and hasattr(self.pg, "abort"):
            self.pg.abort()


SINGLE = TPGroup()

_building: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("tp_group_building", default=SINGLE)


def current_tp_group() -> TPGroup:
    """The group of the model under construction (SINGLE outside `building_with`)."""
    return _building.get()


@contextlib.contextmanager
def building_with(group: TPGroup) -> Iterator[TPGroup]:
    """Layers constructed inside shard themselves over `group`."""
    token = _building.set(group)
    try:
        yield group
    finally:
        _building.reset(token)


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port` tells the others)."""
    return dist.TCPStore(STORE_HOST, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, size, False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def create_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the stage's process group (blocks until every rank has joined, or `timeout_s`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    elif device.type == "cpu":
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    else:
        raise ValueError(f"tensor parallelism runs on cuda (NCCL) or cpu (gloo), not {device.type}")
    return TPGroup(rank=rank, size=size, pg=pg, device=device)
