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
                   dummy: bool) -> Any:
    """The model of subfolder `name`, on `device`, evaluation mode."""
    if not dummy:
        refuse_quantized(model_dir / name)
        return component_class(entry).from_pretrained(model_dir / name, dtype=dtype).to(device).eval()
    cls = component_class(entry)
    with torch.device(device), default_dtype(dtype):  # a 20B model never exists in float32
        if entry[0] != "diffusers":
            from transformers import AutoConfig

            return cls._from_config(AutoConfig.from_pretrained(model_dir / name), dtype=dtype).to(dtype).eval()
        model = cls.from_config(cls.load_config(model_dir / name)).eval()
    _set_dtypes(model, dtype, cls._keep_in_fp32_modules or ())
    return model


def refuse_quantized(component_dir: Path) -> None:
    """A component saved quantized (ModelOpt FP8 / NVFP4, ...: a `quantization_config` in its
    config.json) is refused by name: loading it as plain weights would compute garbage."""
    config = component_dir / "config.json"
    if not config.is_file():
        return
    quant = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", quant.get("quant_algo", "?")) if isinstance(quant, dict) else quant
        raise ValueError(f"{component_dir}: a quantized checkpoint (quantization_config: {method}) is not "
                         "supported by the native diffusion engine; use the unquantized weights")


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
