"""vllm_omni: serving for multi-stage any-to-any models on our own engine.

Public API only, imported on first use (PEP 562): `import vllm_omni` itself loads neither torch
nor an engine, so a process that only needs a light part of the package (the CLI's argument
parser and its error paths, a headless command's launcher, a config check) does not pay for
them. `from vllm_omni import Omni, SamplingParams, ...` works as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni import logging_filters
from vllm_omni.version import __version__

logging_filters.install()


_LAZY = {
    "LLM": "vllm_omni.entrypoints.llm",
    "Omni": "vllm_omni.entrypoints.omni",
    "AsyncOmni": "vllm_omni.entrypoints.async_omni",
    "OmniRequestOutput": "vllm_omni.outputs",
    "RequestOutput": "vllm_omni.outputs",
    "CompletionOutput": "vllm_omni.outputs",
    "SamplingParams": "vllm_omni.sampling_params",
    "DiffusionSamplingParams": "vllm_omni.sampling_params",
}

if TYPE_CHECKING:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.llm import LLM
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.outputs import CompletionOutput, OmniRequestOutput, RequestOutput
    from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_omni' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["LLM", "SamplingParams", "DiffusionSamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
