"""Reading a diffusers pipeline folder (model_index.json plus one subfolder per component), as
diffusers' `from_pretrained` does, for the native diffusion models (Qwen-Image, Wan2.2).

Each component is the class model_index.json names (library, class), loaded from its
subfolder; `dummy` builds the same classes from their configs with random weights, directly
on the device in the target dtype (benchmarks of the real architecture need no checkpoint),
keeping in float32 the parameters diffusers' loader keeps there (`_keep_in_fp32_modules`).
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.model_loader import default_dtype
from vllm_omni.model_executor.models.quantized_checkpoints import (load_gguf_transformer, load_modelopt_fp8,
                                                                    modelopt_fp8_algo, quantization_of)

INDEX = "model_index.json"


def read_index(model_dir: Path, pipelines: tuple[str, ...], family: str) -> dict[str, Any]:
    """model_index.json of a folder whose pipeline is one of `pipelines` (ValueError otherwise)."""
    path = model_dir / INDEX
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a diffusers pipeline folder (no {INDEX})")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("_class_name") not in pipelines:
        raise ValueError(f"{model_dir}: pipeline {index.get('_class_name')!r} is not {family}; expected one of "
                         f"{pipelines} (other pipelines run with --diffusion-load-format diffusers)")
    return index


def component_class(entry: list[str]) -> type:
    library, class_name = entry
    return getattr(importlib.import_module(library), class_name)


def load_component(model_dir: Path, name: str, entry: list[str], device: torch.device, dtype: torch.dtype,
                   dummy: bool, quantization: Any = None) -> Any:
    """The model of subfolder `name`, on `device`, evaluation mode. A transformer comes from a
    GGUF file with `quantization` {"method": "gguf"}; a ModelOpt FP8 folder loads with its FP8
    layers (models/quantized_checkpoints.py)."""
    cls = component_class(entry)
    if quantization is not None and quantization.method == "gguf" and name.startswith("transformer"):
        return load_gguf_transformer(cls, quantization.gguf_model, model_dir, name, dtype, device)
    if not dummy:
        if refuse_quantized(model_dir / name) is not None:
            return load_modelopt_fp8(cls, model_dir / name, device, dtype,
                                     lambda c, config: _random(c, config, device, dtype))
        return cls.from_pretrained(model_dir / name, dtype=dtype).to(device).eval()
    if entry[0] != "diffusers":
        from transformers import AutoConfig

        with torch.device(device), default_dtype(dtype):  # a 20B model never exists in float32
            return cls._from_config(AutoConfig.from_pretrained(model_dir / name), dtype=dtype).to(dtype).eval()
    return _random(cls, cls.load_config(model_dir / name), device, dtype)


def _random(cls: type, config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """A diffusers model of `config` with random weights, built on the device in `dtype`."""
    with torch.device(device), default_dtype(dtype):
        model = cls.from_config(config).eval()
    _set_dtypes(model, dtype, cls._keep_in_fp32_modules or ())
    return model


def refuse_quantized(component_dir: Path) -> str | None:
    """A component saved quantized (a `quantization_config` in its config.json): its ModelOpt FP8
    algorithm, which loads; any other format is refused by name (loading it as plain weights
    would compute garbage). None: not quantized."""
    quant = quantization_of(component_dir)
    return None if quant is None else modelopt_fp8_algo(component_dir, quant)


def load_scheduler(model_dir: Path, entry: list[str], **overrides: Any) -> Any:
    """The scheduler model_index.json names, from its config (with `overrides`)."""
    cls = component_class(entry)
    return cls.from_config({**cls.load_config(model_dir / "scheduler"), **overrides})


def _set_dtypes(model: torch.nn.Module, dtype: torch.dtype, keep_in_float32: Sequence[str]) -> None:
    """diffusers' from_pretrained rule: parameters in `dtype`, except those with a name part in
    keep_in_float32; buffers stay as the model made them (Wan's RoPE tables: float64)."""
    for name, param in model.named_parameters():
        keep = any(part in keep_in_float32 for part in name.split("."))
        param.data = param.data.to(torch.float32 if keep else dtype)


def set_vae_options(vae: Any, slicing: bool, tiling: bool) -> None:
    """diffusers' VAE slicing (one sample at a time) and tiling (large frames in tiles)."""
    if slicing:
        vae.enable_slicing()
    if tiling:
        vae.enable_tiling()
