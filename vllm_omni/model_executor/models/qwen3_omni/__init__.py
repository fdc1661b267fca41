"""Qwen3-Omni-MoE stage models (thinker, talker, code2wav).

Exports resolve lazily: importing the package imports no model module, so the registry
(which imports each stage model by its module path) never meets a circular import.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Qwen3OmniMoeThinkerForConditionalGeneration": "qwen3_omni_moe_thinker",
    "Qwen3OmniMoeTalkerForConditionalGeneration": "qwen3_omni_moe_talker",
    "Qwen3OmniMoeCode2Wav": "qwen3_omni_code2wav",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
