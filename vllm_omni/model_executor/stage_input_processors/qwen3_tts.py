"""Documented bridge path for Qwen3-TTS; the bridge lives in the family folder."""
from vllm_omni.model_executor.models.qwen3_tts.bridges import talker2code2wav

__all__ = ["talker2code2wav"]
