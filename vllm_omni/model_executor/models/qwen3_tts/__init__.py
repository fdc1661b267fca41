"""Qwen3-TTS (12 Hz tokenizer): talker (with its code predictor) -> speech decoder, one family.

    stage      class                                  engine      weights
    talker     Qwen3TTSTalkerForConditionalGeneration ar          talker.* (+ speaker_encoder.*
               (the code predictor runs between                   and the speech tokenizer's
               engine steps, one step = one frame)                encoder for voice cloning)
    code2wav   Qwen3TTSCode2Wav (GenerationModel)     generation  speech_tokenizer/ decoder.*

The three released task types (CustomVoice, VoiceDesign, Base) share these classes; the stage-0
input processor (multimodal/qwen3_tts_input.py) builds the talker's inputs from the text and the
voice. transformers has no Qwen3-TTS config: `hf_config_class` (configuration.py) is registered
with AutoConfig by model_loader.load_hf_config.
"""
from __future__ import annotations

from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

_HERE = "vllm_omni.model_executor.models.qwen3_tts"

FAMILY = ModelFamily(
    name="qwen3_tts",
    architectures=("Qwen3TTSForConditionalGeneration",),
    model_types=("qwen3_tts",),
    stage_models={
        "talker": f"{_HERE}.talker:Qwen3TTSTalkerForConditionalGeneration",
        "code2wav": f"{_HERE}.code2wav:Qwen3TTSCode2Wav",
    },
    bridges={"code2wav": "vllm_omni.model_executor.stage_input_processors.qwen3_tts.talker2code2wav"},
    stream_bridges={"code2wav": f"{_HERE}.bridges.TALKER_TO_CODE2WAV_STREAM"},
    input_processor="vllm_omni.multimodal.qwen3_tts_input:Qwen3TTSInputProcessor",
    pipelines={PipelineVariant.DEFAULT: "qwen3_tts"},
    tiny_checkpoints={"qwen3_tts": "vllm_omni.testing.tiny_qwen3_tts:build_tiny_qwen3_tts"},
    hf_config_class=f"{_HERE}.configuration:Qwen3TTSConfig",
    # Upstream's stage configs (its legacy stage_configs/qwen3_tts*.yaml) name each stage's class.
    upstream_stage_architectures={"Qwen3TTSTalkerForConditionalGeneration": "talker", "Qwen3TTSCode2Wav": "code2wav"},
    upstream_model_stages={"qwen3_tts": "talker"},
    # The same two stages; its deploy file turns streaming off itself (async_chunk: false).
    upstream_pipelines={"qwen3_tts_no_async_chunk": "qwen3_tts"},
)
