"""Qwen2.5-Omni: thinker -> talker -> code2wav (token2wav), one family.

`FAMILY` is the family's registration record (models/family.py). Exports resolve lazily:
importing the package imports no model module, so reading the record costs nothing.
"""
from __future__ import annotations

import importlib
from typing import Any

from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

_HERE = "vllm_omni.model_executor.models.qwen2_5_omni"
_BRIDGES = "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni"

FAMILY = ModelFamily(
    name="qwen2_5_omni",
    # Released checkpoints say Qwen2_5OmniModel; transformers saves Qwen2_5OmniForConditionalGeneration.
    architectures=("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"),
    model_types=("qwen2_5_omni",),
    stage_models={
        "thinker": f"{_HERE}.thinker:Qwen2_5OmniThinkerForConditionalGeneration",
        "talker": f"{_HERE}.talker:Qwen2_5OmniTalkerForConditionalGeneration",
        # code2wav (spec 000's stage name) is a GenerationModel, not a decoder.
        "code2wav": f"{_HERE}.token2wav:Qwen2_5OmniToken2Wav",
    },
    stage_checkpoints={"Qwen2_5OmniThinkerForConditionalGeneration": "thinker", "qwen2_5_omni_thinker": "thinker"},
    # Spec 000's qwen2_5_omni.yaml names the talker's bridge but not code2wav's, whose input must
    # lose the talker's stop token and carry the requested voice.
    # Named by their documented (spec 003) paths, which re-export bridges.py.
    bridges={"talker": f"{_BRIDGES}.thinker2talker", "code2wav": f"{_BRIDGES}.talker2code2wav"},
    stream_bridges={"talker": f"{_HERE}.bridges.THINKER_TO_TALKER_STREAM",
                    "code2wav": f"{_HERE}.bridges.TALKER_TO_CODE2WAV_STREAM"},
    input_processor="vllm_omni.multimodal.input_processors:Qwen2_5OmniPromptProcessor",
    pipelines={PipelineVariant.DEFAULT: "qwen2_5_omni", PipelineVariant.SINGLE_DEVICE: "qwen2_5_omni_single_gpu",
               PipelineVariant.TEXT_ONLY: "qwen2_5_omni_thinker_only"},
    tiny_checkpoints={"qwen2_5_omni": "vllm_omni.testing.tiny_omni:build_tiny_qwen2_5_omni",
                      "qwen2_5_omni_demo": "vllm_omni.testing.tiny_omni:build_demo_qwen2_5_omni"},
)

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
