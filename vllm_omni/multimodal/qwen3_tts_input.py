"""Stage-0 input processor of Qwen3-TTS: a user prompt -> the talker's request.

    {"prompt": "Hello!", "speaker": "Vivian", "instructions": "Speak slowly.", "language": "English"}
    {"prompt": "Hello!", "instructions": "A deep calm voice."}                       (VoiceDesign)
    {"prompt": "Hello!", "ref_audio": <wav bytes | (array, sr) | path | URL | data URL | base64>,
     "ref_text": "transcript of the reference"}                                    (Base)

Runs in the caller's process: bad input is a ValueError (HTTP 400) before anything is queued.
The text is tokenized in qwen-tts' chat layout (tts_request.py); the reference audio is decoded
and resampled to 24 kHz here, and embedded by the talker on its device. A checkpoint serves one
task type (config `tts_model_type`); a request naming another is refused. Defaults follow
qwen-tts: speaker optional, language "Auto", the whole text in the prompt (non-streaming text)
except for voice cloning, which feeds the text as frames are generated.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.qwen3_tts.configuration import TaskType
from vllm_omni.model_executor.models.qwen3_tts.tts_request import TTSRequest

SAMPLE_RATE = 24000


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruction_text(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def load_reference_audio(source: Any) -> torch.Tensor:
    """Mono float32 [N] at 24 kHz from bytes, a (waveform, rate) pair, a path, an http(s) /
    file / data URL, or a bare base64 string (qwen-tts accepts those too). MediaError: bad audio."""
    from vllm_omni.multimodal.media import MediaError, decode_base64, load_audio

    if isinstance(source, str) and not source.startswith(("data:", "http://", "https://", "file:")) \
            and not _is_existing_path(source):
        source = decode_base64(source, "ref_audio")
    wave = load_audio(source, target_sr=SAMPLE_RATE)
    if wave.shape[0] < SAMPLE_RATE // 10:
        raise MediaError(f"ref_audio is too short ({wave.shape[0] / SAMPLE_RATE:.3f} s; at least 0.1 s)")
    return torch.from_numpy(wave)


def _is_existing_path(text: str) -> bool:
    try:
        return len(text) < 4096 and Path(text).expanduser().is_file()
    except OSError:
        return False


class Qwen3TTSInputProcessor:
    def __init__(self, model_dir: str | os.PathLike, tokenizer: Any = None) -> None:
        if tokenizer is None:
            from vllm_omni.model_executor.model_loader import load_tokenizer

            tokenizer = load_tokenizer(os.fspath(model_dir))
        self.tokenizer = tokenizer
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        self.task_type = TaskType.from_model_type(config.get("tts_model_type"))
        # qwen-tts drops the instructions of the 0.6B CustomVoice model (trained without them).
        self.takes_instructions = config.get("tts_model_size") != "0b6" or self.task_type is not TaskType.CUSTOM_VOICE
        talker = config.get("talker_config") or {}
        self.speakers = self.speaker_names(Path(model_dir)) or []
        self.languages = ["auto", *sorted(k for k in talker.get("codec_language_id") or {} if "dialect" not in k)]

    @staticmethod
    def speaker_names(model_dir: Path) -> list[str] | None:
        """The checkpoint's named voices (talker_config.spk_id; None: it has none, as Base and
        VoiceDesign checkpoints, which clone or design their voice)."""
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        return sorted((config.get("talker_config") or {}).get("spk_id") or {}) or None

    def process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        if "messages" in prompt or prompt.get("multi_modal_data") is not None:
            raise ValueError("a TTS model takes a text prompt (and voice options), not chat messages or media")
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the text to speak ('prompt' / 'input') must be a non-empty string")
        request = self.build_request(text, prompt)
        out = OmniTokensPrompt(prompt_token_ids=list(request.text_ids), prompt=text)
        out["additional_information"] = {**dict(prompt.get("additional_information") or {}), **request.to_info()}
        return out

    def build_request(self, text: str, options: Mapping[str, Any]) -> TTSRequest:
        task = self._task_type(options.get("task_type"))
        speaker = self._speaker(options.get("speaker"), task)
        instructions = options.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError("instructions must be a string")
        if instructions and not self.takes_instructions:
            raise ValueError("this 0.6B CustomVoice model takes no instructions (qwen-tts ignores them)")
        if task is TaskType.BASE and instructions:
            raise ValueError("a Base (voice cloning) model takes no instructions; the voice comes from ref_audio")
        if task is TaskType.VOICE_DESIGN and not (instructions or "").strip():
            raise ValueError("VoiceDesign needs 'instructions' describing the voice")
        language = options.get("language") or "auto"
        if not isinstance(language, str) or language.lower() not in self.languages:
            raise ValueError(f"unsupported language {language!r}; supported: {self.languages}")
        ref_audio, ref_ids = self._reference(task, options)
        non_streaming = options.get("non_streaming_mode")
        if non_streaming is None:
            non_streaming = task is not TaskType.BASE
        if not isinstance(non_streaming, bool):
            raise ValueError("non_streaming_mode must be true or false")
        return TTSRequest(text_ids=self._ids(assistant_text(text)), language=language.lower(), speaker=speaker,
                          instruct_ids=self._ids(instruction_text(instructions)) if instructions else None,
                          ref_audio=ref_audio, ref_ids=ref_ids, non_streaming=non_streaming)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _task_type(self, requested: Any) -> TaskType:
        if requested is None:
            return self.task_type
        try:
            task = TaskType(requested)
        except ValueError:
            raise ValueError(f"task_type must be one of {[t.value for t in TaskType]}, got {requested!r}") from None
        if task is not self.task_type:
            raise ValueError(f"this model is a {self.task_type.value} checkpoint; task_type {task.value} needs a "
                             f"{task.value} checkpoint")
        return task

    def _speaker(self, speaker: Any, task: TaskType) -> str | None:
        if speaker is None or speaker == "":
            return None
        if not isinstance(speaker, str):
            raise ValueError(f"speaker must be a voice name (string), got {type(speaker).__name__}")
        if task is not TaskType.CUSTOM_VOICE:
            raise ValueError(f"a {task.value} model has no named speakers; "
                             + ("describe the voice in 'instructions'" if task is TaskType.VOICE_DESIGN
                                else "clone a voice with 'ref_audio'"))
        if speaker.lower() not in self.speakers:
            raise ValueError(f"unknown voice {speaker!r}; available voices: {self.speakers}")
        return speaker.lower()

    def _reference(self, task: TaskType, options: Mapping[str, Any]) -> tuple[torch.Tensor | None, list[int] | None]:
        source, ref_text = options.get("ref_audio"), options.get("ref_text")
        if task is not TaskType.BASE:
            if source is not None or ref_text is not None:
                raise ValueError(f"ref_audio / ref_text need a Base (voice cloning) checkpoint; this is "
                                 f"{task.value}")
            return None, None
        if source is None:
            raise ValueError("voice cloning (Base) needs 'ref_audio'")
        x_vector_only = options.get("x_vector_only_mode", False)
        if not isinstance(x_vector_only, bool):
            raise ValueError("x_vector_only_mode must be true or false")
        if ref_text is not None and not isinstance(ref_text, str):
            raise ValueError("ref_text must be a string")
        if not x_vector_only and not (ref_text or "").strip():
            raise ValueError("voice cloning needs 'ref_text' (the transcript of ref_audio), or "
                             "x_vector_only_mode to clone from the voice alone")
        ref_ids = None if x_vector_only else self._ids(reference_text(ref_text))
        return load_reference_audio(source), ref_ids
