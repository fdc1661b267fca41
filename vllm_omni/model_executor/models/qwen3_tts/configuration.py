"""Qwen3-TTS checkpoint config (`model_type` "qwen3_tts"): read by `AutoConfig`, parsed once.

transformers does not know Qwen3-TTS (it lives in the `qwen-tts` package, which pins an old
transformers). `Qwen3TTSConfig` is a bare PretrainedConfig: every config.json key
becomes an attribute (sections stay dicts), whatever transformers version builds it (5.x
turned configs into dataclasses; a subclass with its own fields behaves differently across
5.17 and 5.24). `TTSConfig.parse` then turns it into frozen dataclasses with the names our
decoders read (`rope_parameters` in transformers 5's form).
"""
from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from vllm_omni.model_executor.models.family import SpeechModel


class TaskType(str, enum.Enum):
    """The three Qwen3-TTS checkpoints (spec 001 `--task-type`), by config `tts_model_type`."""

    CUSTOM_VOICE = "CustomVoice"  # named speakers, optional style instructions
    VOICE_DESIGN = "VoiceDesign"  # a voice described in the instructions
    BASE = "Base"  # voice cloning from reference audio (+ its transcript)

    @property
    def model_type(self) -> str:
        return {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}[self.value]

    @classmethod
    def from_model_type(cls, tts_model_type: Any) -> TaskType:
        for task in cls:
            if task.model_type == tts_model_type:
                return task
        raise ValueError(f"unknown tts_model_type {tts_model_type!r}; known: {[t.model_type for t in cls]}")


class Qwen3TTSConfig(PretrainedConfig):
    """Registered with AutoConfig by model_loader.load_hf_config (the family's hf_config_class)."""

    model_type = "qwen3_tts"


def _pick(cls: type, section: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {**{k: v for k, v in section.items() if k in names}, **extra}


@dataclass(frozen=True)
class DecoderConfig:
    """A dense Qwen3 decoder (the talker's or the code predictor's), as DecoderModel reads it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    num_code_groups: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    use_sliding_window: bool = False

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> DecoderConfig:
        rope = {"rope_type": "default", "rope_theta": float(section.get("rope_theta", 10000))}
        scaling = section.get("rope_scaling") or {}
        rope.update({k: v for k, v in scaling.items() if k in ("mrope_section", "interleaved")})
        return cls(**_pick(cls, section, rope_parameters=rope))


@dataclass(frozen=True)
class TalkerConfig(DecoderConfig):
    code_predictor: DecoderConfig | None = None
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 0
    codec_think_id: int = 0
    codec_nothink_id: int = 0
    codec_think_bos_id: int = 0
    codec_think_eos_id: int = 0
    codec_pad_id: int = 0
    codec_bos_id: int = 0
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, Any] = field(default_factory=dict)
    codec_language_id: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> TalkerConfig:
        decoder = DecoderConfig.parse(section)
        predictor = DecoderConfig.parse(section["code_predictor_config"])
        return cls(**{**decoder.__dict__, **_pick(cls, section, rope_parameters=decoder.rope_parameters,
                                                  code_predictor=predictor)})


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass(frozen=True)
class TTSConfig:
    """The parsed checkpoint config; `model_dir` holds speech_tokenizer/ too."""

    model_dir: str
    task_type: TaskType
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    tts_bos_token_id: int
    tts_eos_token_id: int
    tts_pad_token_id: int
    tts_model_size: str | None = None

    @classmethod
    def parse(cls, config: Any) -> TTSConfig:
        """From the AutoConfig object (or the config.json dict, with `_name_or_path` set)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        task = TaskType.from_model_type(get("tts_model_type"))
        speaker = get("speaker_encoder_config")
        return cls(model_dir=str(get("_name_or_path", "")), task_type=task,
                   talker=TalkerConfig.parse(get("talker_config")),
                   speaker_encoder=SpeakerEncoderConfig(**_pick(SpeakerEncoderConfig, speaker))
                   if task is TaskType.BASE else None,
                   tts_bos_token_id=get("tts_bos_token_id", 151672), tts_eos_token_id=get("tts_eos_token_id", 151673),
                   tts_pad_token_id=get("tts_pad_token_id", 151671), tts_model_size=get("tts_model_size"))


def speech_model(model_dir: str) -> SpeechModel:
    """The family record's `speech_model`: the task, the named voices and the codec's frame size."""
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    codec = json.loads((folder / "speech_tokenizer" / "config.json").read_text(encoding="utf-8"))
    task = TaskType.from_model_type(config.get("tts_model_type"))
    # Only CustomVoice speaks in named voices (the others design or clone theirs).
    voices = (config.get("talker_config") or {}).get("spk_id") or {} if task is TaskType.CUSTOM_VOICE else {}
    # Base clones its stored voices from a recording, VoiceDesign describes them, CustomVoice has its own.
    voices_from = {TaskType.BASE: "audio", TaskType.VOICE_DESIGN: "instructions"}.get(task)
    cloning = "vllm_omni.multimodal.qwen3_tts_voices:Qwen3TTSVoiceCloning" if task is TaskType.BASE else None
    return SpeechModel(task.value, tuple(sorted(voices)), int(codec.get("decode_upsample_rate", 1920)),
                       voices_from, cloning)
