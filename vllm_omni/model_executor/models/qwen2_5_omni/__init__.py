"""Qwen2.5-Omni stage models (thinker, talker, token2wav)."""
from vllm_omni.model_executor.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForConditionalGeneration

__all__ = ["Qwen2_5OmniThinkerForConditionalGeneration"]
