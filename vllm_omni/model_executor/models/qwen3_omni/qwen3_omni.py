"""Qwen3-Omni-MoE: which class serves which stage (spec 003's "unified model class").

Spec 003's `Qwen3OmniMoeForConditionalGeneration` is a wrapper whose constructor branches on
`model_stage` and builds one sub-model. Here that branching is the model registry itself: a
pipeline stage names `model_arch: Qwen3OmniMoeForConditionalGeneration` and its `model_stage`,
and `registry.resolve_model_class(arch, stage)` returns the stage's own class, built from the
full checkpoint config and loading only its own tensors:

    stage      class                                            engine      weights
    thinker    Qwen3OmniMoeThinkerForConditionalGeneration      ar          thinker.*
    talker     Qwen3OmniMoeTalkerForConditionalGeneration       ar          talker.* (+ 3 rows of the
               (its code predictor runs between engine steps)               thinker's embedding table)
    code2wav   Qwen3OmniMoeCode2Wav (GenerationModel)           generation  code2wav.*

The stages are joined by the bridges in stage_input_processors/qwen3_omni.py:
thinker --(input embeddings "0" + layer accept_hidden_layer)--> talker
--(code_predictor_codes [frames, num_code_groups])--> code2wav.
"""
from __future__ import annotations

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
STAGES = ("thinker", "talker", "code2wav")


def stage_model_class(model_stage: str) -> type:
    """The class serving `model_stage` of a Qwen3-Omni-MoE checkpoint."""
    from vllm_omni.model_executor.models.registry import resolve_model_class

    if model_stage not in STAGES:
        raise ValueError(f"unknown Qwen3-Omni stage {model_stage!r}; stages: {list(STAGES)}")
    return resolve_model_class(ARCHITECTURE, model_stage)
