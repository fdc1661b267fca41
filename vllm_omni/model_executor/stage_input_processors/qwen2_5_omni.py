"""Spec 003's documented bridge paths for Qwen2.5-Omni; the bridges live in the family folder."""
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import talker2code2wav, thinker2talker

__all__ = ["thinker2talker", "talker2code2wav"]
