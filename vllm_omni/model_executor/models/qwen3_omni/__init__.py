"""Qwen3-Omni-MoE stage models (thinker, talker, code2wav)."""
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

__all__ = ["Qwen3OmniMoeThinkerForConditionalGeneration"]
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker import (  # noqa: E402
    Qwen3OmniMoeTalkerForConditionalGeneration,
)

__all__ += ["Qwen3OmniMoeTalkerForConditionalGeneration", "Qwen3OmniMoeCode2Wav"]
