"""Qwen3-Omni-MoE: thinker -> talker (with its code predictor) -> code2wav, one family.

`FAMILY` is the family's registration record (models/family.py; qwen3_omni.py tells which
class serves which stage). Exports resolve lazily: importing the package imports no model
module, so reading the record costs nothing.
"""
from __future__ import annotations

import importlib
from typing import Any

from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

_HERE = "vllm_omni.model_executor.models.qwen3_omni"
_BRIDGES = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"

FAMILY = ModelFamily(
    name="qwen3_omni_moe",
    architectures=("Qwen3OmniMoeForConditionalGeneration",),
    model_types=("qwen3_omni_moe",),
    stage_models={
        "thinker": f"{_HERE}.qwen3_omni_moe_thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
        "talker": f"{_HERE}.qwen3_omni_moe_talker:Qwen3OmniMoeTalkerForConditionalGeneration",
        "code2wav": f"{_HERE}.qwen3_omni_code2wav:Qwen3OmniMoeCode2Wav",
    },
    stage_checkpoints={"Qwen3OmniMoeThinkerForConditionalGeneration": "thinker", "qwen3_omni_moe_thinker": "thinker"},
    # Named by their documented (spec 003) paths, which re-export bridges.py.
    bridges={"talker": f"{_BRIDGES}.thinker2talker", "code2wav": f"{_BRIDGES}.talker2code2wav"},
    stream_bridges={"talker": f"{_HERE}.bridges.THINKER_TO_TALKER_STREAM",
                    "code2wav": f"{_HERE}.bridges.TALKER_TO_CODE2WAV_STREAM"},
    input_processor="vllm_omni.multimodal.input_processors:Qwen3OmniPromptProcessor",
    pipelines={PipelineVariant.DEFAULT: "qwen3_omni_moe", PipelineVariant.SINGLE_DEVICE: "qwen3_omni_moe_single_gpu",
               PipelineVariant.TEXT_ONLY: "qwen3_omni_moe_thinker_only"},
    tiny_checkpoints={"qwen3_omni_moe": "vllm_omni.testing.tiny_qwen3_omni:build_tiny_qwen3_omni"},
)

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
