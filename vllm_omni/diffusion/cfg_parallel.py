"""CFG parallelism (`cfg_parallel_size: 2`): the unconditional rows of each step on a second rank.

The stage process is rank 0; it starts rank 1, a child process that loads the same model on
the stage's second device and joins a two-rank torch.distributed group (gloo on the CPU, NCCL
on GPUs). Each step rank 0 broadcasts the unconditional rows' batch (tensors only, see
DiffusionModel.make_batch) and computes the conditional rows meanwhile; rank 1 sends its
velocities back. Guidance is combined on rank 0, so the images equal those of size 1.

Rank 1 exits when rank 0 sends None (close), when rank 0's process is gone (a watchdog
thread checks every second), or when the group breaks. Every collective has the group's
timeout (`init_timeout_s`, which also covers loading the model): a dead rank fails the step
instead of hanging it.
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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.diffusion.layerwise_offload import LayerwiseOffload
from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class ModelSpec:
    """How to build the stage model; picklable, so rank 1 builds the very same model."""

    class_path: str  # "module:Class" with a `load(path, *, device, dtype, ...)` class method
    model_path: str
    dtype: str
    dummy: bool = False
    seed: int = 0  # random (dummy) weights must be equal on both ranks
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    cpu_offload: bool = False
    acceleration: DenoiserAcceleration = DenoiserAcceleration()
    boundary_ratio: float | None = None  # video models (Wan2.2): None keeps the checkpoint's
    flow_shift: float | None = None
    layerwise_offload: bool = False  # the transformer blocks' weights in CPU memory (layerwise_offload.py)

    def build(self, device: torch.device) -> Any:
        if self.dummy:
            torch.manual_seed(self.seed)
        cls = import_dotted(self.class_path)
        extra = {}
        if self.layerwise_offload:
            if "offload_blocks" not in inspect.signature(cls.load).parameters:
                raise ValueError(f"enable_layerwise_offload: {cls.__name__} does not support it (its load() takes "
                                 "no offload_blocks)")
            extra["offload_blocks"] = LayerwiseOffload.install
        return cls.load(
            self.model_path, device=device, dtype=getattr(torch, self.dtype), dummy=self.dummy,
            vae_use_slicing=self.vae_use_slicing, vae_use_tiling=self.vae_use_tiling, cpu_offload=self.cpu_offload,
            acceleration=self.acceleration, boundary_ratio=self.boundary_ratio, flow_shift=self.flow_shift, **extra)


class CfgParallelGroup:
    """Rank 0's handle on rank 1."""

    def __init__(self, process: Any, device: torch.device, address: str, init_timeout_s: float) -> None:
        self.process = process
        self.device = device
        self.address = address
        self.init_timeout_s = init_timeout_s
        self._ready = False

    @classmethod
    def start(cls, spec: ModelSpec, cache_spec: tuple[str, dict[str, Any], bool] | None, device: torch.device,
              init_timeout_s: float = 600.0) -> CfgParallelGroup:
        """Start rank 1 (it loads its model while rank 0 loads its own); `wait_ready` joins the group."""
        import torch.multiprocessing as mp

        address = f"tcp://127.0.0.1:{_free_port()}"
        rank1_device = torch.device("cuda", 1) if device.type == "cuda" else device
        process = mp.get_context("spawn").Process(
            target=_rank1_main, args=(spec, cache_spec, str(rank1_device), address, os.getpid(), init_timeout_s),
            name="cfg-parallel-rank1", daemon=True)
        process.start()
        return cls(process, device, address, init_timeout_s)

    def wait_ready(self) -> None:
        dist.init_process_group(_backend(self.device), init_method=self.address, rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=self.init_timeout_s))
        self._ready = True

    def submit(self, batch: Any, keys: list[Any]) -> None:
        self._check_alive()
        dist.broadcast_object_list([(_to(batch, "cpu"), keys)], src=0)

    def result(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src=1)
        return out

    def close(self) -> None:
        if self._ready and self.process.is_alive():
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError as e:  # rank 1 already gone: nothing to tell it
                logger.info("cfg-parallel rank 1 did not take the stop message: %s", e)
        if self._ready:
            dist.destroy_process_group()
            self._ready = False
        self.process.join(timeout=10.0)
        if self.process.is_alive():
            self.process.kill()

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"the CFG-parallel rank 1 process exited (code {self.process.exitcode})")


def _rank1_main(spec: ModelSpec, cache_spec: tuple[str, dict[str, Any], bool] | None, device_name: str,
                address: str, parent_pid: int, init_timeout_s: float) -> None:
    from vllm_omni.diffusion.denoise import build_cache, run_denoiser

    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = spec.build(device)
    cache = build_cache(cache_spec, model.describe()["transformer"])
    dist.init_process_group(_backend(device), init_method=address, rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=init_timeout_s))
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:
                break
            batch, keys = message[0]
            if cache is not None:
                cache.retain(keys)  # rank 1 sees its rows one forward at a time
            out = run_denoiser(model, _to(batch, device), cache, keys)
            dist.send(out.to("cpu" if device.type == "cpu" else device).contiguous(), dst=0)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _to(batch: Any, device: Any) -> Any:
    """A batch dataclass with its tensors moved."""
    changes = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **changes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
