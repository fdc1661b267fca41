"""Lazy table from HF architecture name to our model class.

Modules are imported only when an architecture is resolved, so importing the registry
costs nothing. Omni checkpoints hold several stage models under one architecture
name; those entries are keyed by (architecture, model_stage), e.g.
("Qwen2_5OmniForConditionalGeneration", "thinker"), and looked up first.
"""
from __future__ import annotations

import importlib

_MODELS = "vllm_omni.model_executor.models"

# architecture -> (module path, class name)
_TEXT_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": (f"{_MODELS}.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": (f"{_MODELS}.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": (f"{_MODELS}.qwen3_moe", "Qwen3MoeForCausalLM"),
}

_QWEN2_5_OMNI_THINKER = (f"{_MODELS}.qwen2_5_omni.thinker", "Qwen2_5OmniThinkerForConditionalGeneration")
# A thinker-only checkpoint names the thinker class itself.
_TEXT_MODELS["Qwen2_5OmniThinkerForConditionalGeneration"] = _QWEN2_5_OMNI_THINKER

# (architecture, model_stage) -> (module path, class name); filled as stage models land.
_STAGE_MODELS: dict[tuple[str, str], tuple[str, str]] = {
    # Released checkpoints say Qwen2_5OmniModel; transformers saves Qwen2_5OmniForConditionalGeneration.
    ("Qwen2_5OmniModel", "thinker"): _QWEN2_5_OMNI_THINKER,
    ("Qwen2_5OmniForConditionalGeneration", "thinker"): _QWEN2_5_OMNI_THINKER,
}
_QWEN2_5_OMNI_TALKER = (f"{_MODELS}.qwen2_5_omni.talker", "Qwen2_5OmniTalkerForConditionalGeneration")
# code2wav (spec 000's stage name) is a generation-stage model (GenerationModel), not a decoder.
_QWEN2_5_OMNI_CODE2WAV = (f"{_MODELS}.qwen2_5_omni.token2wav", "Qwen2_5OmniToken2Wav")
for _arch in ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"):
    _STAGE_MODELS[(_arch, "talker")] = _QWEN2_5_OMNI_TALKER
    _STAGE_MODELS[(_arch, "code2wav")] = _QWEN2_5_OMNI_CODE2WAV


def supported_architectures() -> list[str]:
    """Plain architecture names, then "Arch[stage]" for stage models."""
    return sorted(_TEXT_MODELS) + sorted(f"{arch}[{stage}]" for arch, stage in _STAGE_MODELS)


def resolve_model_class(architecture: str, model_stage: str | None = None) -> type:
    """The class for `architecture` (and `model_stage` for multi-stage checkpoints).

    A plain architecture ignores `model_stage`: a single-stage LLM is the same model
    whatever the stage is called in the pipeline config.
    """
    entry = _STAGE_MODELS.get((architecture, model_stage)) if model_stage is not None else None
    if entry is None:
        entry = _TEXT_MODELS.get(architecture)
    if entry is None:
        stage = f" with model_stage={model_stage!r}" if model_stage is not None else ""
        raise ValueError(
            f"unsupported model architecture {architecture!r}{stage}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_path, class_name = entry
    return getattr(importlib.import_module(module_path), class_name)
