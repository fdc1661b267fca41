"""Checkpoint-to-parameter loading shared by all our models.

A model maps each HF checkpoint name to `(parameter name, shard id)` (or None to skip
it); each parameter's `weight_loader` places the tensor and its `shard_ids` says which
shards must arrive (see `layers/linear.py`). Loading is strict both ways: a checkpoint
tensor without a destination and a parameter shard left unfilled are errors, so a
naming mistake can never leave uninitialized memory in a served model.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm_omni.model_executor.checkpoint_slice import CheckpointSlice
from vllm_omni.model_executor.layers.linear import WHOLE, default_weight_loader

# (parameter name, shard id) for a checkpoint name, or None to skip the tensor.
NameMapper = Callable[[str], "tuple[str, Any] | None"]

# Fused-parameter table of the Qwen family: (fused module, HF module, shard id).
STACKED_PARAMS: tuple[tuple[str, str, Any], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def map_stacked_name(name: str, stacked: Iterable[tuple[str, str, Any]] = STACKED_PARAMS) -> tuple[str, Any]:
    """`...self_attn.k_proj.bias` -> (`...self_attn.qkv_proj.bias`, "k"); others unchanged."""
    for fused, part, shard_id in stacked:
        fragment = f".{part}."
        if fragment in name:
            return name.replace(fragment, f".{fused}."), shard_id
    return name, None


def load_weights_strict(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], map_name: NameMapper
) -> set[str]:
    """Load `weights` into `module`'s parameters; return the names of the parameters loaded."""
    params = dict(module.named_parameters())
    loaded: dict[str, set[Any]] = defaultdict(set)
    for ckpt_name, tensor in weights:
        mapped = map_name(ckpt_name)
        if mapped is None:
            continue
        param_name, shard_id = mapped
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has no destination in {type(module).__name__} "
                f"(mapped to {param_name!r})"
            )
        if shard_id in loaded[param_name]:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} loaded twice into {param_name!r} (shard {shard_id!r})")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, CheckpointSlice) and not getattr(param, "reads_slices", False):
            tensor = tensor.load()  # a replicated parameter: read it whole
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"loading {ckpt_name!r} into {param_name!r}: {exc}") from exc
        loaded[param_name].add(shard_id)

    missing = []
    for name, param in params.items():
        expected = getattr(param, "shard_ids", frozenset(WHOLE))
        absent = expected - loaded.get(name, set())
        if absent:
            shards = "" if absent == {None} else f" (shards {sorted(map(str, absent))})"
            missing.append(f"{name}{shards}")
    if missing:
        raise ValueError(f"{type(module).__name__}: parameters not loaded from the checkpoint: {missing}")
    return set(loaded)
