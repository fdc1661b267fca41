"""The one dtype vocabulary: every spelling a config, flag or caller may use, and its meaning.

    canonical_dtype("bf16")              -> "bfloat16"   (ValueError names the accepted spellings)
    torch_dtype("auto", hf_config)       -> the checkpoint's dtype (float32 if it names none)

Spellings are vLLM's (`auto`, `float32`, `float`, `bfloat16`, `float16`, `half`) plus the short
forms upstream YAMLs use (`fp32`, `bf16`, `fp16`) and `torch.<name>`. The config layer checks
them at parse time with `canonical_dtype`, which imports nothing heavy; `torch_dtype` is what
model loaders call.
"""
from __future__ import annotations

from typing import Any

AUTO = "auto"
# spelling -> canonical name
_SPELLINGS = {
    "auto": AUTO,
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
DTYPE_SPELLINGS = tuple(_SPELLINGS)


def canonical_dtype(value: Any) -> str:
    """A dtype spelling (or a torch.dtype) -> "auto" | "float32" | "bfloat16" | "float16"."""
    name = str(value).removeprefix("torch.") if value is not None else None
    if name not in _SPELLINGS:
        raise ValueError(f"unsupported dtype {value!r}; supported: {', '.join(DTYPE_SPELLINGS)}")
    return _SPELLINGS[name]


def torch_dtype(value: Any, hf_config: Any = None) -> Any:
    """The torch.dtype a spelling stands for; "auto" is the checkpoint's dtype (config `dtype`,
    older `torch_dtype`), float32 when the config names none or there is no config."""
    import torch

    name = canonical_dtype(value)
    if name == AUTO:
        # transformers 5 names it `dtype`; reading `torch_dtype` there only adds a deprecation warning.
        config_dtype = getattr(hf_config, "dtype", None) if hf_config is not None else None
        if config_dtype is None and hf_config is not None:
            config_dtype = getattr(hf_config, "torch_dtype", None)
        if config_dtype is None:
            return torch.float32
        name = canonical_dtype(config_dtype)
        if name == AUTO:
            raise ValueError(f"the checkpoint config's dtype is {config_dtype!r}, not a concrete dtype")
    return getattr(torch, name)
