"""A diffusion stage's process world: CFG, sequence parallelism (Ulysses x ring), HSDP, VAE patches.

Upstream's DiffusionParallelConfig, checked once when the config is built (every problem names
the fields) and used by the diffusion engine to lay out its ranks:

    world_size = cfg_parallel_size x data_parallel_size x ulysses_degree x ring_degree

The stage process is rank 0. Ranks are numbered with Ulysses innermost, then ring, then the HSDP
replicas of standalone HSDP, then the CFG branch:
rank = ((cfg_rank x dp + dp_rank) x ring + ring_rank) x ulysses + ulysses_rank. So a Ulysses group
(the all-to-all, the heaviest traffic) is a run of neighbouring devices and the ring goes across.

HSDP shards the transformer's blocks over a (replicate x shard) mesh of the same ranks. Combined
with other parallelism, replicate x shard must equal their world; alone (no CFG, no sequence
parallelism) it sets the world: its ranks run the same batch in lock step (data_parallel_size
replicas of the computation, only the weights are split). A shard group never spans two CFG
branches (they run different rows, and not always both), so hsdp_replicate_size is a multiple of
cfg_parallel_size. The VAE decode uses ranks 0..vae_patch_parallel_size-1 of the world.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ULYSSES_MODES = ("strict", "advanced_uaa")


class ParallelConfigError(ValueError):
    """A combination of degrees this engine cannot lay out; `field` names the setting to change."""

    def __init__(self, field: str, problem: str, allowed: str | None = None) -> None:
        super().__init__(problem)
        self.field = field
        self.problem = problem
        self.allowed = allowed


@dataclass(frozen=True)
class DiffusionParallelConfig:
    cfg_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    ulysses_mode: str = "strict"
    vae_patch_parallel_size: int = 1
    use_hsdp: bool = False
    hsdp_shard_size: int = -1  # -1: the whole world / hsdp_replicate_size
    hsdp_replicate_size: int = 1
    num_gpus: int | None = None  # when given: must equal world_size

    @classmethod
    def from_engine_args(cls, args: Any) -> DiffusionParallelConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    @property
    def sequence_parallel_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the computation inside the world: standalone HSDP only."""
        return self.hsdp_replicate_size * self.hsdp_shard_size if self._standalone_hsdp else 1

    @property
    def world_size(self) -> int:
        return self.cfg_parallel_size * self.data_parallel_size * self.sequence_parallel_size

    @property
    def branch_size(self) -> int:
        """Ranks that compute one CFG branch together."""
        return self.data_parallel_size * self.sequence_parallel_size

    @property
    def hsdp_shape(self) -> tuple[int, int] | None:
        """(replicate, shard) of the HSDP mesh; None without HSDP."""
        if not self.use_hsdp:
            return None
        shard = self.hsdp_shard_size
        if shard == -1:
            shard = self.cfg_parallel_size * self.sequence_parallel_size // self.hsdp_replicate_size
        return self.hsdp_replicate_size, shard

    @property
    def _standalone_hsdp(self) -> bool:
        return self.use_hsdp and self.cfg_parallel_size * self.sequence_parallel_size == 1

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(cfg_rank, dp_rank, ring_rank, ulysses_rank) of a global rank."""
        rank, ulysses_rank = divmod(rank, self.ulysses_degree)
        rank, ring_rank = divmod(rank, self.ring_degree)
        cfg_rank, dp_rank = divmod(rank, self.data_parallel_size)
        return cfg_rank, dp_rank, ring_rank, ulysses_rank

    def check(self) -> DiffusionParallelConfig:
        """Raise ParallelConfigError for a combination that cannot run; returns self."""
        for name in ("cfg_parallel_size", "ulysses_degree", "ring_degree", "vae_patch_parallel_size",
                     "hsdp_replicate_size"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(name, f"{name} must be at least 1", "an integer >= 1")
        if self.ulysses_mode not in ULYSSES_MODES:
            raise ParallelConfigError("ulysses_mode", f"unknown ulysses_mode {self.ulysses_mode!r}",
                                      " | ".join(ULYSSES_MODES))
        self._check_hsdp()
        if self.vae_patch_parallel_size > self.world_size:
            raise ParallelConfigError(
                "vae_patch_parallel_size", f"vae_patch_parallel_size={self.vae_patch_parallel_size} is more than the "
                f"stage's {self.world_size} rank(s) ({self.describe_world()}): the VAE decode uses the stage's ranks",
                f"1 to {self.world_size}")
        if self.num_gpus is not None and self.num_gpus != self.world_size:
            raise ParallelConfigError(
                "num_gpus", f"num_gpus={self.num_gpus} but the parallel degrees make a world of {self.world_size} "
                f"({self.describe_world()}); set the degrees so that their product is num_gpus (replicas of a "
                "whole stage are runtime.num_replicas / --omni-dp-size-local)", str(self.world_size))
        return self

    def _check_hsdp(self) -> None:
        if not self.use_hsdp:
            for name, off in (("hsdp_shard_size", -1), ("hsdp_replicate_size", 1)):
                if getattr(self, name) != off:
                    raise ParallelConfigError(name, f"{name} is set but use_hsdp is false", f"{off} or use_hsdp: true")
            return
        replicate, shard = self.hsdp_replicate_size, self.hsdp_shard_size
        compute_world = self.cfg_parallel_size * self.sequence_parallel_size
        if shard == -1:
            if compute_world == 1:
                raise ParallelConfigError("hsdp_shard_size", "standalone HSDP (no CFG or sequence parallelism) needs "
                                          "hsdp_shard_size: -1 means 'the world of the other degrees', which is 1",
                                          "an integer >= 1")
            if compute_world % replicate:
                raise ParallelConfigError("hsdp_replicate_size", f"hsdp_replicate_size={replicate} does not divide "
                                          f"the world of {compute_world} ({self.describe_world()})")
        elif shard < 1:
            raise ParallelConfigError("hsdp_shard_size", "hsdp_shard_size must be -1 (auto) or at least 1")
        elif compute_world > 1 and replicate * shard != compute_world:
            raise ParallelConfigError("hsdp_shard_size", f"hsdp_replicate_size x hsdp_shard_size = {replicate * shard} "
                                      f"must equal the world of the other degrees, {compute_world} "
                                      f"({self.describe_world()})")
        if replicate % self.cfg_parallel_size:
            raise ParallelConfigError("hsdp_replicate_size", "an HSDP shard group stays inside one CFG branch (the two "
                                      f"branches run different rows): hsdp_replicate_size={replicate} must be a "
                                      f"multiple of cfg_parallel_size={self.cfg_parallel_size}")

    def describe_world(self) -> str:
        parts = [f"cfg_parallel_size={self.cfg_parallel_size}", f"ulysses_degree={self.ulysses_degree}",
                 f"ring_degree={self.ring_degree}"]
        if self._standalone_hsdp:
            parts.append(f"standalone HSDP {self.hsdp_replicate_size} x {self.hsdp_shard_size}")
        return " x ".join(parts)

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "cfg_parallel_size": self.cfg_parallel_size,
                "ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree,
                "ulysses_mode": self.ulysses_mode, "vae_patch_parallel_size": self.vae_patch_parallel_size,
                "hsdp": list(self.hsdp_shape) if self.hsdp_shape else None}
