"""Spec 003's documented bridge paths for Qwen3-Omni; the bridges live in the family folder."""
from vllm_omni.model_executor.models.qwen3_omni.bridges import talker2code2wav, thinker2talker

__all__ = ["thinker2talker", "talker2code2wav"]
