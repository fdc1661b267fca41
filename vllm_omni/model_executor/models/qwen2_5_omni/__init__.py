"""Qwen2.5-Omni stage models (thinker, talker, token2wav).

Exports resolve lazily: importing the package imports no model module, so the registry
(which imports each stage model by its module path) never meets a circular import.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Qwen2_5OmniThinkerForConditionalGeneration": "thinker",
    "Qwen2_5OmniTalkerForConditionalGeneration": "talker",
    "Qwen2_5OmniToken2Wav": "token2wav",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
