"""Qwen3-TTS Base voice cloning for the server's voices endpoint (family.VoiceCloning).

The recording is decoded as an inline `ref_audio` is (qwen3_tts_input.load_reference_audio), so a
stored voice speaks as the same file given inline; the encoders are the talker's own
(model_executor/models/qwen3_tts/voice_encoder.py).
"""
from __future__ import annotations

from typing import Any

from vllm_omni.multimodal.media_policy import MediaPolicy
from vllm_omni.multimodal.qwen3_tts_input import SAMPLE_RATE, load_reference_audio


class Qwen3TTSVoiceCloning:
    sample_rate = SAMPLE_RATE

    @staticmethod
    def load_sample(data: bytes, policy: MediaPolicy) -> Any:
        return load_reference_audio(data, policy)

    @staticmethod
    def fingerprint(model_dir: str) -> str:
        from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import voice_fingerprint

        return voice_fingerprint(model_dir)

    @staticmethod
    def encoder(model_dir: str) -> Any:
        from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder

        return VoiceEncoder.load(model_dir)
