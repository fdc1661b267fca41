"""vllm_omni: serving for multi-stage any-to-any models on our own engine.

Public API only; heavy modules are imported on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni import logging_filters
from vllm_omni.outputs import CompletionOutput, RequestOutput
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams
from vllm_omni.version import __version__

logging_filters.install()


_LAZY = {
    "LLM": "vllm_omni.entrypoints.llm",
    "Omni": "vllm_omni.entrypoints.omni",
    "AsyncOmni": "vllm_omni.entrypoints.async_omni",
    "OmniRequestOutput": "vllm_omni.outputs",
}

if TYPE_CHECKING:
    from vllm_omni.entrypoints.llm import LLM


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_omni' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "SamplingParams", "DiffusionSamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
