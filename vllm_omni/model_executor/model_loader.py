"""Build a registered model on its device and dtype and fill it from safetensors."""
from __future__ import annotations

import contextlib
import json
import zlib
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.checkpoint_slice import CheckpointSlice, DummyCheckpointTensor
from vllm_omni.model_executor.dtypes import torch_dtype
from vllm_omni.model_executor.models.registry import resolve_model_class
from vllm_omni.model_executor.parallel_state import current_tp_group

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

def load_hf_config(model: str | Path) -> PretrainedConfig:
    """`AutoConfig.from_pretrained`, also for families whose config class transformers lacks."""
    from transformers import AutoConfig

    _register_config_classes()
    return AutoConfig.from_pretrained(model)


def load_tokenizer(model: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained`, which reads the model's config first: with our config classes
    registered it finds them, rather than falling back to a bare PretrainedConfig with a warning
    ("You are using a model of type `qwen3_tts` to instantiate a model of type ``")."""
    from transformers import AutoTokenizer

    _register_config_classes()
    return AutoTokenizer.from_pretrained(model)


def _register_config_classes() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vllm_omni.imports import import_dotted
    from vllm_omni.model_executor.models.families import FAMILIES

    for family in FAMILIES:
        if family.hf_config_class is not None and family.model_types[0] not in CONFIG_MAPPING:
            AutoConfig.register(family.model_types[0], import_dotted(family.hf_config_class))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def iterate_safetensors(model_dir: str | Path, num_threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor of the checkpoint in `model_dir`, in
    the files' order.

    One thread: each tensor is a view of the memory-mapped file, read from disk when the model
    copies it into its parameter. More (`--num-weight-load-threads`): that many threads read the
    tensors ahead of the model's loader (each into memory of its own), the order and the values
    unchanged; at most 2 x num_threads tensors wait in memory."""
    if num_threads < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")
    if num_threads == 1:
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    yield from _read_ahead(safetensors_files(model_dir), num_threads)


def _read_ahead(paths: list[Path], num_threads: int) -> Iterator[tuple[str, torch.Tensor]]:
    # clone() touches every page of the mapping: the disk reads happen in the pool's threads
    # (torch releases the GIL while it copies), not when the loader copies the tensor.
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in paths]
        names = ((f, name) for f in handles for name in f.keys())
        pool = stack.enter_context(ThreadPoolExecutor(num_threads, thread_name_prefix="weight-load"))
        stack.callback(pool.shutdown, cancel_futures=True)  # a loader that stops early leaves no reads queued
        pending: deque[tuple[str, Future[torch.Tensor]]] = deque()
        for f, name in names:
            pending.append((name, pool.submit(lambda f=f, name=name: f.get_tensor(name).clone())))
            if len(pending) >= 2 * num_threads:
                name, future = pending.popleft()
                yield name, future.result()
        while pending:
            name, future = pending.popleft()
            yield name, future.result()


def iterate_safetensors_slices(model_dir: str | Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """Like `iterate_safetensors`, but nothing is read until a loader asks: a tensor-parallel
    rank reads only its shard of each sharded tensor. Each slice is valid until the next one."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointSlice(f, name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    hf_config: PretrainedConfig,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    architecture: str | None = None,
    model_stage: str | None = None,
    load_format: str = "auto",
    predictor_sampling: Mapping[str, Any] | None = None,
    load_threads: int = 1,
) -> nn.Module:
    """Construct the registered class for `architecture` (default: the config's first
    architecture) directly on `device` in `dtype`, then load the checkpoint into it, read by
    `load_threads` threads (`iterate_safetensors`).

    load_format "dummy" skips the checkpoint and fills every parameter with seeded random
    values: the real architecture's shapes and cost, for benchmarks without weights.
    predictor_sampling: a talker's code predictor settings (the stage's subtalker_sampling_params)."""
    if architecture is None:
        if not hf_config.architectures:
            raise ValueError(f"config of {model_dir} names no architecture; pass architecture=")
        architecture = hf_config.architectures[0]
    model_cls = resolve_model_class(architecture, model_stage)
    param_dtype = torch_dtype(dtype, hf_config)
    # Parameters are allocated (uninitialized) on the target device in the target dtype,
    # so no full-size float32 CPU copy ever exists.
    with default_dtype(param_dtype), torch.device(device):
        model = model_cls(hf_config)
    if predictor_sampling:
        model.set_predictor_sampling(predictor_sampling)
    if load_format == "dummy":
        fill_dummy_weights(model)
    elif load_format == "auto" and current_tp_group().size > 1:
        model.load_weights(iterate_safetensors_slices(model_dir))
    elif load_format == "auto":
        model.load_weights(iterate_safetensors(model_dir, load_threads))
    else:
        raise ValueError(f"load_format={load_format!r} is invalid: must be 'auto' or 'dummy'")
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights, small enough that activations stay finite in bf16; norms at 1.

    Values are seeded per parameter (and shard) name, and sharded parameters take their part of
    the full tensor through their loaders: every tensor-parallel size gets the same model."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        elif getattr(param, "reads_slices", False):
            for shard_id in param.shard_ids:
                param.weight_loader(param, DummyCheckpointTensor(_name_seed(seed, f"{name}:{shard_id}"), std),
                                    shard_id)
        else:
            generator = torch.Generator(device=param.device).manual_seed(_name_seed(seed, name))
            param.normal_(0.0, std, generator=generator)


def _name_seed(seed: int, name: str) -> int:
    return seed * 2**32 + zlib.crc32(name.encode())


def prefixed_tensors(model_path: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under `prefix`, unprefixed; reads nothing else (a stage model of a
    whole checkpoint, e.g. code2wav next to a thinker of many GB)."""
    from safetensors import safe_open

    state = {}
    for path in safetensors_files(model_path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state.update((k[len(prefix):], f.get_tensor(k)) for k in f.keys() if k.startswith(prefix))
    if not state:
        raise ValueError(f"{model_path}: the checkpoint has no {prefix}* tensors")
    return state
