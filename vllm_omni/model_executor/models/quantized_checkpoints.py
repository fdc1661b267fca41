"""Transformers whose weights are stored quantized: ModelOpt FP8 component folders and GGUF files.

- ModelOpt FP8 (a diffusers component folder whose config.json has a `quantization_config` of
  ModelOpt, quant_algo "FP8_PER_CHANNEL_PER_TOKEN" or "FP8"): every linear layer whose weight is
  stored as float8_e4m3fn becomes an Fp8Linear with the stored `weight_scale` (per channel, or
  per tensor) and, for "FP8", the stored static per-tensor `input_scale`; the other tensors load
  as usual. Other quantized formats (NVFP4, FP8_PB_WO, AWQ, GPTQ, ...) are refused by name.
- GGUF (`--diffusion-quantization-config '{"method": "gguf", "gguf_model": PATH}'`): diffusers'
  single-file loader with its GGUF quantizer (which needs the `gguf` package, the diffusion
  extra): the transformer is built from the folder's transformer/config.json and its weights
  come from the file, converted from the original checkpoint names where the model has
  original names (Wan). Quantized tensors (Q8_0, Q4_K, ...) stay quantized in memory and each
  linear layer dequantizes its weight when it runs (diffusers' GGUFLinear): the memory of the
  file, the arithmetic of the compute dtype.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_omni.model_executor.layers.fp8_linear import FP8_DTYPE, Fp8Linear

MODELOPT_FP8_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "FP8")


def quantization_of(component_dir: Path) -> dict[str, Any] | None:
    """The `quantization_config` of a component folder's config.json (None: not quantized)."""
    config = component_dir / "config.json"
    if not config.is_file():
        return None
    quant = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    return quant if quant is None or isinstance(quant, dict) else {"quant_method": str(quant)}


def modelopt_fp8_algo(component_dir: Path, quant: dict[str, Any]) -> str:
    """The ModelOpt FP8 algorithm of a quantized component; ValueError names what is not supported."""
    method = str(quant.get("quant_method") or quant.get("producer", {}).get("name") or "?").lower()
    algo = quant.get("quant_algo") or quant.get("quantization", {}).get("quant_algo")
    kv = quant.get("kv_cache_quant_algo") or quant.get("quantization", {}).get("kv_cache_quant_algo")
    if method != "modelopt" or algo not in MODELOPT_FP8_ALGOS:
        raise ValueError(f"{component_dir}: a quantized checkpoint (quantization_config: {method}"
                         f"{f' {algo}' if algo else ''}) is not supported by the native diffusion engine: it loads "
                         f"ModelOpt FP8 ({' | '.join(MODELOPT_FP8_ALGOS)}); use those or the unquantized weights")
    if kv is not None:
        raise ValueError(f"{component_dir}: ModelOpt kv_cache_quant_algo {kv}: calibrated attention scales are not "
                         "supported (--diffusion-kv-cache-dtype fp8 quantizes K and V dynamically)")
    return algo


def load_modelopt_fp8(cls: type, component_dir: Path, device: torch.device, dtype: torch.dtype,
                      build: Any) -> nn.Module:
    """The component with its FP8 linear layers. `build(cls, config)`: the model of that config with
    random weights in `dtype` on `device` (diffusers_folder's dummy builder), which the file then fills."""
    config = {k: v for k, v in cls.load_config(component_dir).items() if k != "quantization_config"}
    model = build(cls, config)
    state = _read_safetensors(component_dir)
    fp8_names = [k[:-len(".weight")] for k, t in state.items() if k.endswith(".weight") and t.dtype == FP8_DTYPE]
    for name in fp8_names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{component_dir}: {name}.weight is FP8 but {name} is a {type(linear).__name__}, not a "
                             "linear layer")
        if f"{name}.weight_scale" not in state:
            raise ValueError(f"{component_dir}: {name}.weight is FP8 without a weight_scale")
        bias = state.pop(f"{name}.bias", None)
        layer = Fp8Linear(state.pop(f"{name}.weight").to(device), state.pop(f"{name}.weight_scale").to(device),
                          None if bias is None else bias.to(device, dtype),
                          input_scale=_maybe(state.pop(f"{name}.input_scale", None), device))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    fp8_buffers = {f"{n}.{b}" for n in fp8_names for b in ("weight", "weight_scale", "input_scale", "bias")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in fp8_buffers]
    if missing or unexpected:
        raise ValueError(f"{component_dir}: the checkpoint does not fit {cls.__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.eval()


def _maybe(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _read_safetensors(component_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(component_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{component_dir}: no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_gguf_transformer(cls: type, gguf_file: str, model_dir: Path, subfolder: str, dtype: torch.dtype,
                          device: torch.device) -> nn.Module:
    """The transformer of `model_dir/subfolder`'s config with the weights of a GGUF file."""
    path = Path(gguf_file)
    if not path.is_file():
        raise ValueError(f"gguf_model {gguf_file!r} is not a file")
    try:
        import gguf  # noqa: F401 - diffusers' GGUF quantizer needs it
    except ImportError:
        raise ValueError("GGUF checkpoints need the `gguf` package (pip install 'vllm-omni[diffusion]')") from None
    from diffusers import GGUFQuantizationConfig

    model = cls.from_single_file(str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                 config=str(model_dir), subfolder=subfolder, torch_dtype=dtype, local_files_only=True)
    return model.to(device).eval()
