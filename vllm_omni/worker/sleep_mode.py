"""Sleep mode of a stage (`enable_sleep_mode`; vLLM's POST /sleep, /wake_up, GET /is_sleeping).

Sleeping drops the stage's engine: its weights, its KV cache (the prefix cache with it), its CUDA
graphs and their memory pools, and what the caching allocator kept, go back to the device. At
level 1 the weights are first copied into CPU memory (pinned on CUDA); level 2 keeps nothing.
Waking builds the engine again the way the stage started: at level 2 from the checkpoint; at
level 1 without reading it (random weights of the same shapes, `load_format: dummy`), then the
CPU copy is written into those very tensors. The KV cache is sized and allocated again (empty),
CUDA graphs are captured again.

Why build again rather than free and refill tensors in place: captured CUDA graphs (decode,
prefill, code predictors, vocoders) hold the device addresses of the weights and the KV cache,
and a refilled tensor lives at another address. vLLM keeps the addresses with a virtual-memory
allocator of its own (CuMemAllocator); here the graphs are captured again, which makes waking up
take about as long as the stage's start-up without the checkpoint read (level 1).

A stage sleeps only when it holds no request (`SleepRefused` otherwise; the orchestrator admits
none while the pipeline sleeps). The same code runs on the CPU, where the tests exercise it.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import torch
from torch import nn

from vllm_omni.config.stage_config import StageConfig
from vllm_omni.stage_io import StageEngine, StageInfo, StageInputChunk, StageOutput, StageRequest, error_output

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")  # what /wake_up?tags= may name (vLLM's tags)
_MAX_DEPTH = 6  # how deep the weights are looked for in an engine's attributes
_MAX_SETTLE_STEPS = 100  # an idle engine's leftovers take one or two


class SleepRefused(RuntimeError):
    """The stage holds requests: it cannot sleep now."""


class SleepableEngine:
    """A stage engine that can drop itself and be built again (the StageEngine protocol, forwarded).

    `build(from_snapshot)` builds the stage's engine: from the checkpoint, or with placeholder
    weights that a snapshot will overwrite (from_snapshot=True)."""

    def __init__(self, stage_id: int, engine: StageEngine, build: Callable[[bool], StageEngine]) -> None:
        self.stage_id = stage_id
        self._engine: StageEngine | None = engine
        self._build = build
        self._info = engine.describe()
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._woken: set[str] = set()  # tags woken so far while asleep
        self._ready: list[StageOutput] = []  # refusals of requests that came while asleep

    @property
    def sleeping(self) -> bool:
        return self._engine is None

    # --- sleep and wake up ------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not 1 or 2")
        if self._engine is None:  # already asleep: level 2 also drops the CPU copy
            if level == 2:
                self._snapshot = None
            return
        unfinished = self._engine.stats()["num_unfinished"]
        if unfinished:
            raise SleepRefused(f"stage {self.stage_id} holds {unfinished} request(s)")
        self._settle()
        self._snapshot = snapshot_weights(self._engine) if level == 1 else None
        self._engine = None
        self._woken = set()
        release_device_memory()
        logger.info("stage %d sleeps (level %d)", self.stage_id, level)

    def _settle(self) -> None:
        """Finish what aborted requests left (a step launched before the abort, error outputs): their
        outputs go out with the next step() as usual."""
        for _ in range(_MAX_SETTLE_STEPS):
            if not self._engine.has_work():
                return
            self._ready += self._engine.step()
        raise SleepRefused(f"stage {self.stage_id} still has work after {_MAX_SETTLE_STEPS} steps")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake the parts named (None: all). The engine is built once weights and KV cache are both
        woken: it allocates both (a wake with one tag only records it)."""
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known: {list(WAKE_TAGS)}")
        if self._engine is not None:
            return
        self._woken |= set(tags or WAKE_TAGS)
        if self._woken != set(WAKE_TAGS):
            return
        engine = self._build(self._snapshot is not None)
        if self._snapshot is not None:
            restore_weights(engine, self._snapshot)
        self._engine, self._snapshot = engine, None
        logger.info("stage %d is awake", self.stage_id)

    # --- StageEngine ------------------------------------------------------------------------
    def add_request(self, req: StageRequest) -> None:
        if self._engine is None:
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id} is sleeping (POST /wake_up)"))
        else:
            self._engine.add_request(req)

    def add_input(self, chunk: StageInputChunk) -> None:
        if self._engine is not None:  # asleep, the request it belongs to was refused
            self._engine.add_input(chunk)

    def abort(self, request_ids: Sequence[str]) -> None:
        if self._engine is not None:
            self._engine.abort(request_ids)

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        if self._engine is not None:
            self._engine.pause(request_ids, paused)

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        if self._engine is not None:
            outputs += self._engine.step()
        return outputs

    def has_work(self) -> bool:
        return bool(self._ready) or (self._engine is not None and self._engine.has_work())

    def poll_ms(self) -> int | None:
        return self._engine.poll_ms() if self._engine is not None else None

    def fail_all(self, error: str) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        return outputs + (self._engine.fail_all(error) if self._engine is not None else [])

    def stats(self) -> dict[str, int]:
        return self._engine.stats() if self._engine is not None else {"num_unfinished": 0}

    def describe(self) -> StageInfo:
        return msgspec.structs.replace(self._info, details={**self._info.details, "sleep_mode": True})


def placeholder_weights(stage: StageConfig) -> StageConfig:
    """The stage with random weights of the same shapes instead of its checkpoint (load_format dummy):
    what a level 1 wake-up builds before it writes the snapshot in."""
    return dataclasses.replace(stage, engine_args=dataclasses.replace(stage.engine_args, load_format="dummy"))


def snapshot_weights(engine: Any) -> dict[str, torch.Tensor]:
    """CPU copies (pinned on CUDA) of every weight and persistent buffer of the engine's modules."""
    copies = {}
    for name, tensor in _named_tensors(engine):
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        copies[name] = copy.copy_(tensor.detach(), non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return copies


@torch.no_grad()
def restore_weights(engine: Any, snapshot: dict[str, torch.Tensor]) -> None:
    """Write a snapshot into a freshly built engine of the same stage (in place: the tensors keep
    the addresses its CUDA graphs were captured with)."""
    tensors = dict(_named_tensors(engine))
    if tensors.keys() != snapshot.keys():
        missing, extra = sorted(snapshot.keys() - tensors.keys()), sorted(tensors.keys() - snapshot.keys())
        raise RuntimeError(f"the rebuilt engine's weights are not those it slept with: missing {missing[:5]}, "
                           f"new {extra[:5]}")
    for name, tensor in tensors.items():
        tensor.copy_(snapshot[name], non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_device_memory() -> None:
    """After an engine is dropped: collect it (reference cycles), forget compiled code that holds
    its modules (when anything was compiled: importing the compiler costs seconds), and hand the
    allocator's cached blocks back to the device."""
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _named_tensors(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of the modules an engine holds, once each, named by
    the attribute path that reaches its module first. Two builds of one stage hold their modules
    in the same attributes, in the same order, so the names match."""
    seen: set[int] = set()
    for path, module in _modules(engine, "", 0, set()):
        for name, tensor in module.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                yield f"{path}/{name}", tensor


def _modules(obj: Any, path: str, depth: int, visited: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """nn.Modules reachable through attributes of our own objects, dataclasses, lists and dicts."""
    if id(obj) in visited or depth > _MAX_DEPTH:
        return
    visited.add(id(obj))
    if isinstance(obj, nn.Module):
        yield path, obj
        return
    if isinstance(obj, (list, tuple)):
        children = [(str(i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        children = [(str(k), v) for k, v in obj.items()]
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("vllm_omni."):
        children = list(getattr(obj, "__dict__", {}).items())
    else:
        return
    for name, child in children:
        yield from _modules(child, f"{path}.{name}" if path else name, depth + 1, visited)
