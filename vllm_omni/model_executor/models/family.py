"""A model family's registration record: everything the rest of the system looks up by model.

Each family folder (`models/qwen3_omni/`, ...) defines one `FAMILY = ModelFamily(...)` in its
`__init__.py`, and `families.py` lists them. The model registry (stage -> class), the
default bridges, the stage-0 input processor, the bundled pipeline lookup and the tiny
checkpoint builders all read these records; none keeps a table of its own.

A record holds names, not objects ("package.module:Attr" or "package.module.attr"), so
reading it imports nothing heavy: the config layer uses it to pick a bundled pipeline
without loading a model.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SpeechModel:
    """What a text-to-speech checkpoint says of itself (the server's /v1/audio/speech reads it)."""

    task_type: str  # how it makes its voice (Qwen3-TTS: "CustomVoice", "VoiceDesign", "Base")
    voices: tuple[str, ...]  # the named voices a request may pick; empty: it takes none
    samples_per_frame: int  # audio samples per codec frame (usage counts frames)
    # What a stored voice of this checkpoint is made from (POST /v1/audio/voices): "audio" (a
    # recording and its transcript, encoded by `voice_cloning`), "instructions" (a description
    # spoken inline), None: its voices are its named ones.
    voices_from: str | None = None
    # "module:Class" of the family's VoiceCloning (with voices_from "audio"); see that protocol.
    voice_cloning: str | None = None


class VoiceCloning(Protocol):
    """How a family clones a voice from a recording, for the server's voices endpoint (a class
    of static methods, named by SpeechModel.voice_cloning; Qwen3-TTS: multimodal/qwen3_tts_voices.py)."""

    sample_rate: int  # of what load_sample returns

    @staticmethod
    def load_sample(data: bytes, policy: Any) -> Any:
        """The recording -> [N] float32 at sample_rate, decoded as the input processor decodes
        an inline reference, under `policy` (multimodal/media_policy.MediaPolicy: its decode
        limits hold while decoding; MediaError: bad audio)."""

    @staticmethod
    def fingerprint(model_dir: str) -> str:
        """What a cloned voice depends on (its encoders): voices of another fingerprint are refused."""

    @staticmethod
    def encoder(model_dir: str) -> Any:
        """The loaded encoders: `.encode(wave, ref_text)` -> models/cloned_voice.ClonedVoice."""


class PipelineVariant(str, enum.Enum):
    """Bundled pipelines of one family (each a legacy stage_args YAML + a deploy YAML)."""

    DEFAULT = "default"
    SINGLE_DEVICE = "single_device"  # every stage on one device; chosen when one GPU is visible
    TEXT_ONLY = "text_only"  # no audio output stages; chosen by output_modalities without audio


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # HF `architectures` / `model_type` values of a whole checkpoint of this family.
    architectures: tuple[str, ...]
    model_types: tuple[str, ...] = ()
    # model_stage -> "module:Class" of the stage model (AR decoder or GenerationModel).
    stage_models: Mapping[str, str] = field(default_factory=dict)
    # A plain one-stage model (an LLM): its class, whatever the stage is called.
    single_stage_model: str | None = None
    # Checkpoints that hold one stage alone (a thinker saved by itself): architecture or
    # model_type -> the model_stage it holds. They run the TEXT_ONLY pipeline.
    stage_checkpoints: Mapping[str, str] = field(default_factory=dict)
    # model_stage -> dotted bridge it needs when its stage config names no
    # custom_process_input_func (spec 003 stage input processor).
    bridges: Mapping[str, str] = field(default_factory=dict)
    # model_stage -> dotted stage_io.StreamBridge: how a streaming edge (async_chunk) feeds it.
    stream_bridges: Mapping[str, str] = field(default_factory=dict)
    # "module:Class" built as Class(model_dir, tokenizer): the user prompt -> stage-0 input.
    input_processor: str | None = None
    pipelines: Mapping[PipelineVariant, str] = field(default_factory=dict)  # -> bundled pipeline name
    # `python -m vllm_omni.testing NAME DIR` -> "module:builder" (see testing/tiny_models.py).
    tiny_checkpoints: Mapping[str, str] = field(default_factory=dict)
    # "module:Class": the config class of model_types[0] when transformers has none (Qwen3-TTS);
    # model_loader.load_hf_config registers it with AutoConfig before reading a checkpoint.
    hf_config_class: str | None = None
    # "module:function" (model_dir -> SpeechModel) for a family that speaks its text prompt
    # (text to speech: /v1/audio/speech, `generate` without a chat template); None: it does not.
    speech_model: str | None = None
    # Upstream vLLM-Omni's names in stage configs, read as ours (config/build.py): a per-stage
    # architecture (`model_arch: Qwen3TTSCode2Wav`) -> the model_stage it is, and upstream's
    # model_stage spellings (`qwen3_tts` for the talker) -> ours.
    upstream_stage_architectures: Mapping[str, str] = field(default_factory=dict)
    upstream_model_stages: Mapping[str, str] = field(default_factory=dict)
    # Upstream's pipeline registry keys (a deploy file's `pipeline:`) -> our bundled pipeline name.
    upstream_pipelines: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.single_stage_model is None) == (not self.stage_models):
            raise ValueError(f"family {self.name}: give stage_models or single_stage_model, not both or neither")
        if unknown := set(self.upstream_pipelines.values()) - set(self.pipelines.values()):
            raise ValueError(f"family {self.name}: upstream_pipelines name no pipeline of its own: {sorted(unknown)}")
        for stage in (*self.stage_checkpoints.values(), *self.bridges, *self.stream_bridges,
                      *self.upstream_stage_architectures.values(), *self.upstream_model_stages.values()):
            if stage not in self.stage_models:
                raise ValueError(f"family {self.name}: stage {stage!r} has no entry in stage_models")

    @property
    def speaks_from_text(self) -> bool:
        return self.speech_model is not None

    def matches(self, hf_config: Mapping[str, Any]) -> bool:
        """Whether an HF config (as a dict) is a checkpoint of this family."""
        return self.checkpoint_stage(hf_config) is not None or self._is_whole(hf_config)

    def _is_whole(self, hf_config: Mapping[str, Any]) -> bool:
        archs = hf_config.get("architectures") or []
        return hf_config.get("model_type") in self.model_types or any(a in self.architectures for a in archs)

    def checkpoint_stage(self, hf_config: Mapping[str, Any]) -> str | None:
        """The stage a one-stage checkpoint holds (a thinker saved alone), else None."""
        keys = [hf_config.get("model_type"), *(hf_config.get("architectures") or [])]
        return next((self.stage_checkpoints[k] for k in keys if k in self.stage_checkpoints), None)

    def model_class_path(self, architecture: str, model_stage: str | None) -> str | None:
        """"module:Class" serving `model_stage` of a checkpoint named `architecture`, or None
        when the architecture is not this family's. ValueError: a stage it does not have."""
        if self.single_stage_model is not None:
            return self.single_stage_model if architecture in self.architectures else None
        if architecture in self.stage_checkpoints:
            return self.stage_models[self.stage_checkpoints[architecture]]
        if architecture not in self.architectures:
            return None
        if model_stage not in self.stage_models:
            raise ValueError(f"{architecture} has no model_stage {model_stage!r}; stages: {sorted(self.stage_models)}")
        return self.stage_models[model_stage]

    def canonical_stage(self, architecture: str, model_stage: str | None) -> tuple[str, str | None] | None:
        """(architecture, model_stage) in this family's own names, for a stage config that may use
        upstream's (see `upstream_stage_architectures`); None when `architecture` is not this
        family's. ValueError: a per-stage architecture contradicted by its model_stage."""
        if architecture in self.upstream_stage_architectures:
            stage = self.upstream_stage_architectures[architecture]
            given = self.upstream_model_stages.get(model_stage, model_stage)
            if given not in (None, stage):
                raise ValueError(f"{architecture} is the {stage!r} stage of {self.architectures[0]}; "
                                 f"model_stage {model_stage!r} contradicts it")
            return self.architectures[0], stage
        if architecture in self.architectures:
            return architecture, self.upstream_model_stages.get(model_stage, model_stage)
        return None
