"""Every model family the system knows: one line per family.

A multi-stage family is a folder whose `__init__.py` defines `FAMILY` (models/family.py); a
plain LLM is one module and needs only the small record below. The registry, the bundled
pipeline lookup, the input processors and the tiny checkpoint builders read `FAMILIES`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.models.family import ModelFamily, SpeechModel
from vllm_omni.model_executor.models.qwen2_5_omni import FAMILY as QWEN2_5_OMNI
from vllm_omni.model_executor.models.qwen3_omni import FAMILY as QWEN3_OMNI
from vllm_omni.model_executor.models.qwen3_tts import FAMILY as QWEN3_TTS
from vllm_omni.model_executor.models.qwen_image import FAMILY as QWEN_IMAGE
from vllm_omni.model_executor.models.wan2_2 import FAMILY as WAN2_2


def _llm(name: str, module: str, architecture: str, demo: bool = False) -> ModelFamily:
    """A plain decoder LLM: one AR stage, no bundled pipeline, a tiny checkpoint named `name`
    (and `<name>_demo`, the embedded text demo, where `demo`)."""
    tiny = {name: f"vllm_omni.testing.tiny_models:build_tiny_{name}"}
    if demo:
        tiny[f"{name}_demo"] = f"vllm_omni.testing.tiny_models:build_demo_{name}"
    return ModelFamily(name=name, architectures=(architecture,), model_types=(name,),
                       single_stage_model=f"vllm_omni.model_executor.models.{module}:{architecture}",
                       tiny_checkpoints=tiny)


FAMILIES: tuple[ModelFamily, ...] = (
    _llm("qwen2", "qwen2", "Qwen2ForCausalLM"),
    _llm("qwen3", "qwen3", "Qwen3ForCausalLM", demo=True),
    _llm("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
    QWEN2_5_OMNI,
    QWEN3_OMNI,
    QWEN3_TTS,
    QWEN_IMAGE,
    WAN2_2,
)


def family_of(hf_config: Mapping[str, Any]) -> ModelFamily | None:
    """The family of a checkpoint (its HF config as a dict), or None."""
    return next((f for f in FAMILIES if f.matches(hf_config)), None)


def family_by_name(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")


def local_family(model_dir: str | Path) -> ModelFamily | None:
    """The family of a local checkpoint folder (its config.json), None for anything else."""
    config = Path(model_dir) / "config.json"
    return family_of(json.loads(config.read_text(encoding="utf-8"))) if config.is_file() else None


def speech_model(model_dir: str | Path) -> SpeechModel | None:
    """What a text-to-speech checkpoint says of itself (its family reads it); None for any other model."""
    family = local_family(model_dir)
    if family is None or family.speech_model is None:
        return None
    return import_dotted(family.speech_model)(str(model_dir))


def canonical_stage(architecture: str | None, model_stage: str | None) -> tuple[str | None, str | None]:
    """A stage config's (model_arch, model_stage) in the family's own names (upstream vLLM-Omni's
    per-stage architectures and stage names are aliases, ModelFamily.canonical_stage); names of
    no family (a user's dotted class, a typo) come back as they are."""
    if architecture is not None:
        for family in FAMILIES:
            found = family.canonical_stage(architecture, model_stage)
            if found is not None:
                return found
    return architecture, model_stage


def diffusion_pipelines() -> tuple[str, ...]:
    """Pipeline class names (diffusers' `_class_name`, a stage's `model_class_name`) that our
    diffusion engine runs: the architectures of every family with a diffusion stage model."""
    return tuple(sorted(a for f in FAMILIES if "diffusion" in f.stage_models for a in f.architectures))
