"""The ranks of a diffusion stage: CFG parallelism, sequence parallelism, HSDP, patch-parallel VAE.

The stage process is rank 0. It starts ranks 1..N-1 (`N = world_size` of the stage's
DiffusionParallelConfig), child processes on the stage's next devices that join one
torch.distributed group (gloo on the CPU, NCCL on GPUs), build the groups of the layout
(rank_groups.py) and load the same model with them. Rank 0 alone schedules, prepares requests
and returns outputs; the others follow its messages:

- STEP: each CFG branch's batch (tensors only, see DiffusionModel.make_batch). Every rank runs
  its branch's denoiser forward (the model splits the sequence over its sequence-parallel group
  and gathers the result; HSDP gathers weights block by block). The branch's lowest rank sends
  the velocities of branch 1 to rank 0; rank 0 computes branch 0 itself.
- DECODE: finished requests' latents; the first vae_patch_parallel_size ranks decode a band of
  rows each and rank 0 gathers the image.
- None: close.

A rank exits when rank 0 says so, when rank 0's process is gone (a watchdog thread checks every
second) or when the group breaks. Every collective has the group's timeout (`init_timeout_s`,
which also bounds loading the model): a dead rank fails the step instead of hanging it.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.rank_groups import RankGroups, build_groups
from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.layers.diffusion_parallel import DiffusionParallelism
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0
_EXIT_TIMEOUT_S = 30.0  # a rank told to stop exits at once; its interpreter's teardown can take seconds
STEP, DECODE = "step", "decode"
Branch = tuple[Any, Sequence[Any]]  # (a model batch, its cache row keys)
CacheSpec = tuple[str, dict[str, Any], bool]  # (cache_backend, cache_config, enable_cache_dit_summary)


@dataclass(frozen=True)
class ModelSpec:
    """How to build the stage model; picklable, so every rank builds the very same model."""

    class_path: str  # "module:Class" with a `load(path, *, device, dtype, ...)` class method
    model_path: str
    dtype: str
    dummy: bool = False
    seed: int = 0  # random (dummy) weights must be equal on every rank
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    cpu_offload: bool = False
    acceleration: DenoiserAcceleration = DenoiserAcceleration()
    boundary_ratio: float | None = None  # video models (Wan2.2): None keeps the checkpoint's
    flow_shift: float | None = None
    layerwise_offload: bool = False  # the transformer blocks' weights in CPU memory (layerwise_offload.py)

    def build(self, device: torch.device, parallel: DiffusionParallelism | None = None) -> Any:
        """`parallel`: the rank and the model's groups (sequence parallelism, VAE patches, HSDP). A
        model class whose `load` takes no `parallel` runs alone or as a CFG-parallel rank (that
        needs no model support), and is refused with the others."""
        if self.dummy:
            torch.manual_seed(self.seed)
        cls = import_dotted(self.class_path)
        params = inspect.signature(cls.load).parameters
        extra = {}
        if parallel is not None and "parallel" in params:
            extra["parallel"] = parallel
        elif parallel is not None and parallel.active:
            raise ValueError(f"{cls.__name__} does not implement sequence parallelism, HSDP or patch-parallel VAE "
                             "decoding (its load() takes no `parallel`); use cfg_parallel_size alone")
        if self.layerwise_offload:
            if "offload_blocks" not in params:
                raise ValueError(f"enable_layerwise_offload: {cls.__name__} does not support it (its load() takes "
                                 "no offload_blocks)")
            from vllm_omni.diffusion.layerwise_offload import LayerwiseOffload

            extra["offload_blocks"] = LayerwiseOffload.install
        return cls.load(
            self.model_path, device=device, dtype=getattr(torch, self.dtype), dummy=self.dummy,
            vae_use_slicing=self.vae_use_slicing, vae_use_tiling=self.vae_use_tiling, cpu_offload=self.cpu_offload,
            acceleration=self.acceleration, boundary_ratio=self.boundary_ratio, flow_shift=self.flow_shift, **extra)


def make_cache(model: Any, cache_spec: CacheSpec | None, groups: RankGroups | None) -> Any:
    """The rank's cache (None without one, denoise.build_cache); ranks of one branch follow its
    leader's skip decisions, and rank 0 alone logs cache-dit's summary."""
    from vllm_omni.diffusion.denoise import build_cache

    if cache_spec is not None and groups is not None and groups.rank != 0:
        cache_spec = (cache_spec[0], cache_spec[1], False)
    agree = groups.agree if groups is not None and groups.branch_group is not None else None
    return build_cache(cache_spec, model.describe()["transformer"], agree)


class DiffusionProcessGroup:
    """Rank 0's handle on the other ranks."""

    def __init__(self, processes: list[Any], device: torch.device, address: str, layout: DiffusionParallelConfig,
                 init_timeout_s: float) -> None:
        self.processes = processes
        self.device = device
        self.address = address
        self.layout = layout
        self.init_timeout_s = init_timeout_s
        self.groups: RankGroups | None = None
        self._serving = False

    @classmethod
    def start(cls, spec: ModelSpec, cache_spec: CacheSpec | None, device: torch.device,
              layout: DiffusionParallelConfig, init_timeout_s: float = 600.0) -> DiffusionProcessGroup:
        """Start ranks 1..N-1; `join` makes rank 0 a member, `wait_loaded` waits for their models."""
        import torch.multiprocessing as mp

        address = f"tcp://127.0.0.1:{_free_port()}"
        processes = []
        for rank in range(1, layout.world_size):
            process = mp.get_context("spawn").Process(
                target=_rank_main, name=f"diffusion-rank{rank}", daemon=True,
                args=(spec, cache_spec, str(rank_device(device, rank)), address, os.getpid(), init_timeout_s, layout,
                      rank))
            process.start()
            processes.append(process)
        return cls(processes, device, address, layout, init_timeout_s)

    def join(self) -> DiffusionParallelism:
        """Rank 0 joins the world and builds its groups; the model's groups are returned."""
        dist.init_process_group(_backend(self.device), init_method=self.address, rank=0,
                                world_size=self.layout.world_size,
                                timeout=datetime.timedelta(seconds=self.init_timeout_s))
        self.groups = build_groups(self.layout, 0, self.device)
        return self.groups.model

    def wait_loaded(self) -> None:
        """Every rank loaded its model (or the first error)."""
        errors: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(errors, None)
        failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
        if failed:
            raise RuntimeError(f"diffusion rank {failed[0][0]} could not load the model: {failed[0][1]}")
        self._serving = True

    @property
    def cfg_size(self) -> int:
        return self.layout.cfg_parallel_size

    def forward(self, compute: Callable[[Any, Sequence[Any]], torch.Tensor], branches: Sequence[Branch | None],
                retained: Sequence[Any] = ()) -> list[torch.Tensor | None]:
        """Each CFG branch's velocities: branch 0 computed here by `compute(batch, keys)` (with the
        other ranks of its branch), the others received from their branch's leader. `retained`:
        the cache rows of the running requests, which every rank's cache keeps (rank 0's did)."""
        self._check_alive()
        shared = [None if b is None or (i == 0 and self.layout.branch_size == 1) else (_moved(b[0], "cpu"), b[1])
                  for i, b in enumerate(branches)]
        dist.broadcast_object_list([(STEP, (shared, list(retained)))], src=0)
        first = compute(*branches[0])
        outputs: list[torch.Tensor | None] = [first]
        for branch, item in enumerate(branches[1:], start=1):
            if item is None:
                outputs.append(None)
                continue
            out = torch.empty((len(item[1]), *first.shape[1:]), dtype=first.dtype, device=self.device)
            dist.recv(out, src=branch * self.layout.branch_size)
            outputs.append(out)
        return outputs

    def decode(self, decode: Callable[..., Any], prepared: Sequence[Any], latents: Sequence[torch.Tensor]) -> Any:
        """`decode(prepared, latents)` here, with the VAE patch ranks when there are several."""
        if self.layout.vae_patch_parallel_size > 1:
            self._check_alive()
            dist.broadcast_object_list([(DECODE, _moved((list(prepared), list(latents)), "cpu"))], src=0)
        return decode(prepared, latents)

    def close(self) -> None:
        """Stop the other ranks: a message when they serve, otherwise (a failed start) a kill."""
        serving, self._serving = self._serving, False
        if serving and all(p.is_alive() for p in self.processes):
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError as e:  # a rank already gone: nothing to tell it
                logger.info("diffusion ranks did not take the stop message: %s", e)
        if not serving:
            for process in self.processes:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        for process in self.processes:
            process.join(timeout=_EXIT_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"diffusion rank {rank} exited (code {process.exitcode})")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th device after rank 0's (the stage's runtime.devices, in order)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def _rank_main(spec: ModelSpec, cache_spec: CacheSpec | None, device_name: str, address: str, parent_pid: int,
               init_timeout_s: float, layout: DiffusionParallelConfig, rank: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), init_method=address, rank=rank, world_size=layout.world_size,
                            timeout=datetime.timedelta(seconds=init_timeout_s))
    groups = build_groups(layout, rank, device)
    model, error = None, None
    try:
        model = spec.build(device, groups.model)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the stage's start with it
        error = f"{type(e).__name__}: {e}"
    dist.all_gather_object([None] * layout.world_size, error)
    if error is None:
        with torch.inference_mode():
            _serve(model, make_cache(model, cache_spec, groups), groups)
    dist.destroy_process_group()


def _serve(model: Any, cache: Any, groups: RankGroups) -> None:
    from vllm_omni.diffusion.denoise import run_denoiser

    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return
        kind, payload = message[0]
        if kind == DECODE:
            if groups.model.vae is not None:
                model.decode(*_moved(payload, groups.device))
            continue
        branches, retained = payload
        if cache is not None:
            cache.retain(retained)
        item = branches[groups.branch]
        if item is None:
            continue
        batch, keys = item
        out = run_denoiser(model, _moved(batch, groups.device), cache, keys)
        if groups.branch > 0 and groups.rank == groups.branch_leader:
            dist.send(out.contiguous(), dst=0)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _moved(obj: Any, device: Any) -> Any:
    """`obj` with every tensor in it (dataclass fields, lists, tuples) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if type(obj) in (list, tuple):
        return type(obj)(_moved(x, device) for x in obj)
    return obj


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
