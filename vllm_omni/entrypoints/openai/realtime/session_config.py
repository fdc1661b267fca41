"""A session's effective configuration, and how `session.update` changes it.

Fields left out of an update keep their value; `turn_detection: null` turns server VAD off
(the client then commits audio and asks for responses itself). Where OpenAI's defaults fit,
they are ours: server VAD on, PCM16 at 24 kHz both ways, audio output (with its transcript).
Unlike OpenAI, the voice may change between responses, and the input rate is any rate in
[8000, 48000] Hz (the server resamples).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE
from vllm_omni.entrypoints.openai.realtime.audio import AudioFormat
from vllm_omni.entrypoints.openai.realtime.protocol import AudioOutputIn, ProtocolError, SessionIn, TurnDetectionIn
from vllm_omni.entrypoints.openai.realtime.vad import VadParams


@dataclass(frozen=True)
class ModelAbilities:
    """What the served model offers a session."""

    names: tuple[str, ...]  # the served model names (the first is reported)
    can_speak: bool  # the pipeline has an audio output
    voices: tuple[str, ...]  # names the talker accepts (empty: no audio output)

    @property
    def name(self) -> str:
        return self.names[0]

    def check_voice(self, voice: str | None, param: str) -> str | None:
        """The model's own spelling of `voice` (matched case-insensitively), or a ProtocolError."""
        if voice is None:
            return None
        for known in self.voices:
            if known.lower() == voice.lower():
                return known
        raise ProtocolError(f"unknown voice {voice!r}; this model has {list(self.voices)}", param=param)

    def check_modalities(self, modalities: list[str], param: str) -> tuple[str, ...]:
        if not modalities:
            raise ProtocolError("output_modalities must name 'text' or 'audio'", param=param)
        if "audio" in modalities and not self.can_speak:
            raise ProtocolError(f"{self.name} has no audio output; use output_modalities ['text']", param=param)
        # ["text", "audio"] (the beta API's default) means audio with its transcript, as ["audio"].
        return ("audio",) if "audio" in modalities else ("text",)


@dataclass(frozen=True)
class SessionConfig:
    model: str
    output_modalities: tuple[str, ...]
    instructions: str = ""  # empty: the model's own default system prompt (its chat template's)
    input_format: AudioFormat = field(default_factory=AudioFormat)
    turn_detection: VadParams | None = field(default_factory=VadParams)
    voice: str | None = None  # None: the model's default voice
    max_output_tokens: int | None = None  # None ("inf"): the stage's default

    @classmethod
    def default(cls, model: ModelAbilities) -> SessionConfig:
        return cls(model=model.name, output_modalities=("audio",) if model.can_speak else ("text",))

    def updated(self, s: SessionIn, model: ModelAbilities) -> SessionConfig:
        changes: dict[str, object] = {}
        if s.model is not None and s.model not in model.names:
            raise ProtocolError(f"this server serves {list(model.names)}, not {s.model!r}", param="session.model")
        if s.instructions is not None:
            changes["instructions"] = s.instructions
        if s.output_modalities is not None:
            changes["output_modalities"] = model.check_modalities(s.output_modalities, "session.output_modalities")
        if s.max_output_tokens is not None:
            changes["max_output_tokens"] = None if s.max_output_tokens == "inf" else s.max_output_tokens
        audio_in = s.audio.input if s.audio else None
        if audio_in is not None and audio_in.format is not None:
            changes["input_format"] = _input_format(audio_in.format.type, audio_in.format.rate)
        if audio_in is not None and "turn_detection" in audio_in.model_fields_set:
            changes["turn_detection"] = _vad(audio_in.turn_detection, self.turn_detection)
        audio_out = s.audio.output if s.audio else None
        if audio_out is not None and audio_out.voice is not None:
            changes["voice"] = model.check_voice(audio_out.voice, "session.audio.output.voice")
        return dataclasses.replace(self, **changes)

    def wire(self, session_id: str, expires_at: int) -> dict[str, object]:
        vad = self.turn_detection
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "audio": {
                "input": {"format": self.input_format.wire(), "transcription": None, "noise_reduction": None,
                          "turn_detection": None if vad is None else {"type": "server_vad", **dataclasses.asdict(vad),
                                                                       "idle_timeout_ms": None}},
                "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_SAMPLE_RATE}, "voice": self.voice,
                           "speed": 1.0},
            },
            "tools": [], "tool_choice": "auto", "tracing": None, "truncation": "auto", "prompt": None,
            "expires_at": expires_at, "include": None,
        }


def _input_format(kind: str, rate: int | None) -> AudioFormat:
    default_rate = OUTPUT_SAMPLE_RATE if kind == "audio/pcm" else 8000
    try:
        return AudioFormat(kind, default_rate if rate is None else rate)
    except ValueError as e:
        raise ProtocolError(str(e), param="session.audio.input.format") from None


def _vad(given: TurnDetectionIn | None, current: VadParams | None) -> VadParams | None:
    if given is None:
        return None
    base = current or VadParams()
    set_fields = {k: getattr(given, k) for k in given.model_fields_set if k not in ("type", "idle_timeout_ms")}
    return dataclasses.replace(base, **{k: v for k, v in set_fields.items() if v is not None})


def response_voice(audio: AudioOutputIn | None, model: ModelAbilities, default: str | None) -> str | None:
    if audio is None or audio.voice is None:
        return default
    return model.check_voice(audio.voice, "response.audio.output.voice")
