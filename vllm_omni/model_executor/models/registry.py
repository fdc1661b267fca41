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


# Bridges a stage model needs when its stage config names none (spec 000's qwen2_5_omni.yaml
# names the talker's but not code2wav's, whose input must lose the talker's stop token and
# carry the requested voice; the spec 003 default would pass the raw token ids).
_BRIDGES = "vllm_omni.model_executor.stage_input_processors"
_DEFAULT_BRIDGES: dict[tuple[str, str], str] = {}
for _arch in ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"):
    _DEFAULT_BRIDGES[(_arch, "talker")] = f"{_BRIDGES}.qwen2_5_omni.thinker2talker"
    _DEFAULT_BRIDGES[(_arch, "code2wav")] = f"{_BRIDGES}.qwen2_5_omni.talker2code2wav"


def default_stage_input_processor(architecture: str | None, model_stage: str | None) -> str | None:
    """Dotted name of the bridge a stage model expects by default, or None (spec 003 default)."""
    if architecture is None or model_stage is None:
        return None
    return _DEFAULT_BRIDGES.get((architecture, model_stage))


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


# Qwen3-Omni-MoE thinker: a stage of the whole checkpoint, or a thinker-only checkpoint.
_QWEN3_OMNI_THINKER = (f"{_MODELS}.qwen3_omni.qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration")
_STAGE_MODELS[("Qwen3OmniMoeForConditionalGeneration", "thinker")] = _QWEN3_OMNI_THINKER
_TEXT_MODELS["Qwen3OmniMoeThinkerForConditionalGeneration"] = _QWEN3_OMNI_THINKER

# Qwen3-Omni-MoE talker (AR: codec frames, code predictor inside) and code2wav (GenerationModel);
# qwen3_omni/qwen3_omni.py describes the stage -> class mapping.
_STAGE_MODELS[("Qwen3OmniMoeForConditionalGeneration", "talker")] = (
    f"{_MODELS}.qwen3_omni.qwen3_omni_moe_talker", "Qwen3OmniMoeTalkerForConditionalGeneration")
_STAGE_MODELS[("Qwen3OmniMoeForConditionalGeneration", "code2wav")] = (
    f"{_MODELS}.qwen3_omni.qwen3_omni_code2wav", "Qwen3OmniMoeCode2Wav")
