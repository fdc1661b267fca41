"""Architecture (+ model_stage) -> our model class, read from the family records.

Modules are imported only when a class is resolved, so importing the registry costs nothing.
A multi-stage checkpoint holds several stage models under one architecture name; its family
record maps each `model_stage` (e.g. "thinker") to a class. A plain LLM ignores `model_stage`:
it is the same model whatever the stage is called in the pipeline config.
"""
from __future__ import annotations

from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.models.families import FAMILIES
from vllm_omni.model_executor.models.generation_model import GenerationModel


def supported_architectures() -> list[str]:
    """Plain architecture names, then "Arch[stage]" for stage models."""
    names = []
    for family in FAMILIES:
        if family.single_stage_model is not None:
            names.extend(family.architectures)
        else:
            names.extend(f"{arch}[{stage}]" for arch in family.architectures for stage in family.stage_models)
            names.extend(family.stage_checkpoints)
    return sorted(set(names))


def resolve_model_class(architecture: str, model_stage: str | None = None) -> type:
    """The class for `architecture` (and `model_stage` for multi-stage checkpoints)."""
    for family in FAMILIES:
        path = family.model_class_path(architecture, model_stage)
        if path is not None:
            return import_dotted(path)
    stage = f" with model_stage={model_stage!r}" if model_stage is not None else ""
    raise ValueError(f"unsupported model architecture {architecture!r}{stage}; "
                     f"supported: {', '.join(supported_architectures())}")


def resolve_stage_model_class(model_arch: str, model_stage: str | None = None) -> type:
    """A stage's model class: `model_arch` as a dotted path to a user's class, else registered."""
    if "." in model_arch:
        return import_dotted(model_arch)
    return resolve_model_class(model_arch, model_stage)


def resolve_generation_model_class(model_arch: str, model_stage: str | None = None) -> type[GenerationModel]:
    """A generation stage's model class (registered or a user's dotted path); ValueError when it
    is not a GenerationModel (the interface the generation engine drives)."""
    cls = resolve_stage_model_class(model_arch, model_stage)
    if not (isinstance(cls, type) and issubclass(cls, GenerationModel)):
        raise ValueError(f"{model_arch} is not a GenerationModel (vllm_omni.model_executor.models.generation_model): "
                         "a generation stage runs a subclass of it")
    return cls


def default_stage_input_processor(architecture: str | None, model_stage: str | None) -> str | None:
    """Dotted name of the bridge a stage model expects by default, or None (spec 003 default)."""
    if architecture is None or model_stage is None:
        return None
    for family in FAMILIES:
        if architecture in family.architectures:
            return family.bridges.get(model_stage)
    return None
