"""Stage-0 input processor of Qwen3-TTS: a user prompt -> the talker's request.

    {"prompt": "Hello!", "speaker": "Vivian", "instructions": "Speak slowly.", "language": "English"}
    {"prompt": "Hello!", "instructions": "A deep calm voice."}                       (VoiceDesign)
    {"prompt": "Hello!", "ref_audio": <wav bytes | (array, sr) | path | URL | data URL | base64>,
     "ref_text": "transcript of the reference"}                                    (Base)
    {"prompt": "Hello!", "cloned_voice": ClonedVoice}        (Base: a stored voice, voice_encoder.py)
    {"prompt": "Hello,", "text_complete": False, "max_frames_per_token": 4.0}  (text that streams in:
        AsyncOmni.generate(..., input_complete=False), then append_input({"prompt": " more"}, final))

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
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.cloned_voice import ClonedVoice
from vllm_omni.model_executor.models.qwen3_tts.configuration import TaskType
from vllm_omni.model_executor.models.qwen3_tts.prompt import min_streamed_text_tokens
from vllm_omni.model_executor.models.qwen3_tts.tts_request import TEXT_IDS_KEY, TTSRequest
from vllm_omni.multimodal.media_policy import TRUSTED, MediaPolicy

SAMPLE_RATE = 24000


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruction_text(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def load_reference_audio(source: Any, policy: MediaPolicy = TRUSTED) -> torch.Tensor:
    """Mono float32 [N] at 24 kHz from bytes, a (waveform, rate) pair, a path, an http(s) /
    file / data URL, or a bare base64 string (qwen-tts accepts those too), read and decoded
    under `policy`. MediaError: bad audio."""
    from vllm_omni.multimodal.media import MediaError, decode_base64, load_audio

    if isinstance(source, str) and not source.startswith(("data:", "http://", "https://", "file:")) \
            and not _is_existing_path(source, policy):
        source = decode_base64(source, "ref_audio")
    wave = load_audio(source, policy, target_sr=SAMPLE_RATE)
    if wave.shape[0] < SAMPLE_RATE // 10:
        raise MediaError(f"ref_audio is too short ({wave.shape[0] / SAMPLE_RATE:.3f} s; at least 0.1 s)")
    return torch.from_numpy(wave)


def _is_existing_path(text: str, policy: MediaPolicy) -> bool:
    """Only where local files may be read: elsewhere a path is not looked at (no existence oracle)."""
    root = policy.allowed_local_root
    try:
        path = Path(text).expanduser().resolve()
        return root is not None and len(text) < 4096 and path.is_relative_to(root.resolve()) and path.is_file()
    except OSError:
        return False


@dataclass(frozen=True)
class _Reference:
    """A cloned voice's inputs: the reference audio (the talker encodes it), or a stored voice's
    encodings; ref_ids: its transcript (in-context cloning)."""

    audio: torch.Tensor | None = None
    speaker: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    ref_ids: list[int] | None = None

    def frames(self, samples_per_frame: int) -> int:
        if self.codes is not None:
            return self.codes.shape[0]
        return -(-self.audio.shape[0] // samples_per_frame) if self.audio is not None and self.ref_ids else 0


class Qwen3TTSInputProcessor:
    def __init__(self, model_dir: str | os.PathLike, tokenizer: Any = None, media: MediaPolicy = TRUSTED) -> None:
        if tokenizer is None:
            from vllm_omni.model_executor.model_loader import load_tokenizer

            tokenizer = load_tokenizer(os.fspath(model_dir))
        self.tokenizer = tokenizer
        self.text_lock = threading.Lock()  # the tokenizer; reference audio is decoded outside it
        self.media = media
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        self.task_type = TaskType.from_model_type(config.get("tts_model_type"))
        speech = Path(model_dir) / "speech_tokenizer" / "config.json"
        self.samples_per_frame = int(json.loads(speech.read_text(encoding="utf-8")).get("encode_downsample_rate", 1920)) \
            if speech.is_file() else 1920
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
        reference = self._reference(task, options)
        complete, per_token = self._streamed_text(options)
        non_streaming = options.get("non_streaming_mode")
        if non_streaming is None:
            non_streaming = task is not TaskType.BASE and complete
        if not isinstance(non_streaming, bool):
            raise ValueError("non_streaming_mode must be true or false")
        if non_streaming and not complete:
            raise ValueError("text that streams in is read one token per frame: non_streaming_mode must be false")
        text_ids = self._ids(assistant_text(text))
        needed = min_streamed_text_tokens(reference.ref_ids, reference.frames(self.samples_per_frame))
        if not complete and len(text_ids) - 8 < needed:
            raise ValueError(f"streamed text needs {needed} tokens before it can start (a cloned voice's "
                             f"reference is laid beside the text); it has {len(text_ids) - 8}")
        return TTSRequest(text_ids=text_ids, language=language.lower(), speaker=speaker,
                          instruct_ids=self._ids(instruction_text(instructions)) if instructions else None,
                          ref_audio=reference.audio, ref_speaker=reference.speaker, ref_codes=reference.codes,
                          ref_ids=reference.ref_ids, non_streaming=non_streaming, text_complete=complete,
                          max_frames_per_token=per_token)

    # --- text that streams in (AsyncOmni.generate(..., input_complete=False)) --------
    def process_delta(self, delta: Mapping[str, Any]) -> dict[str, Any]:
        """More text of a request whose text streams in: {"prompt": " and more."} -> the talker's
        chunk. Tokenized on its own: split the text where its tokens split (after a space or
        punctuation) and the ids are those of the whole text."""
        unknown = set(delta) - {"prompt"}
        text = delta.get("prompt", "")
        if unknown or not isinstance(text, str):
            raise ValueError(f"more streamed text is {{'prompt': str}}, got keys {sorted(delta)}")
        return {TEXT_IDS_KEY: self._ids(text)} if text else {}

    def streamed_start_tokens(self, options: Mapping[str, Any]) -> int:
        """Tokens of text a request whose text streams in needs before it starts (1, or more for a
        stored voice cloned in context: its reference frames are laid beside the text)."""
        voice = options.get("cloned_voice")
        if not isinstance(voice, ClonedVoice) or voice.codes is None or options.get("x_vector_only_mode"):
            return 1
        return min_streamed_text_tokens(self._ids(reference_text(voice.ref_text)), voice.codes.shape[0])

    def count_tokens(self, text: str) -> int:
        return len(self._ids(text))

    @staticmethod
    def _streamed_text(options: Mapping[str, Any]) -> tuple[bool, float]:
        complete = options.get("text_complete", True)
        per_token = options.get("max_frames_per_token", 0.0)
        if not isinstance(complete, bool):
            raise ValueError("text_complete must be true or false")
        if isinstance(per_token, bool) or not isinstance(per_token, (int, float)) or not 0 <= per_token <= 100:
            raise ValueError(f"max_frames_per_token must be a number in [0, 100], got {per_token!r}")
        return complete, float(per_token)

    def _ids(self, text: str) -> list[int]:
        with self.text_lock:
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

    def _reference(self, task: TaskType, options: Mapping[str, Any]) -> _Reference:
        source, ref_text, stored = options.get("ref_audio"), options.get("ref_text"), options.get("cloned_voice")
        if task is not TaskType.BASE:
            if source is not None or ref_text is not None or stored is not None:
                raise ValueError(f"ref_audio / ref_text / a cloned voice need a Base (voice cloning) checkpoint; "
                                 f"this is {task.value}")
            return _Reference()
        x_vector_only = options.get("x_vector_only_mode", False)
        if not isinstance(x_vector_only, bool):
            raise ValueError("x_vector_only_mode must be true or false")
        if stored is not None:
            return self._stored_reference(stored, source, ref_text, x_vector_only)
        if source is None:
            raise ValueError("voice cloning (Base) needs 'ref_audio' or a cloned voice")
        if ref_text is not None and not isinstance(ref_text, str):
            raise ValueError("ref_text must be a string")
        if not x_vector_only and not (ref_text or "").strip():
            raise ValueError("voice cloning needs 'ref_text' (the transcript of ref_audio), or "
                             "x_vector_only_mode to clone from the voice alone")
        ref_ids = None if x_vector_only else self._ids(reference_text(ref_text))
        return _Reference(audio=load_reference_audio(source, self.media), ref_ids=ref_ids)

    def _stored_reference(self, voice: Any, source: Any, ref_text: Any, x_vector_only: bool) -> _Reference:
        """A stored voice: its encodings instead of the reference audio (an x-vector-only request
        uses its speaker row alone)."""
        if not isinstance(voice, ClonedVoice):
            raise ValueError(f"cloned_voice must be a ClonedVoice, got {type(voice).__name__}")
        if source is not None or ref_text is not None:
            raise ValueError("a stored voice brings its reference: give no ref_audio / ref_text with it")
        if x_vector_only or voice.codes is None:
            return _Reference(speaker=voice.speaker)
        return _Reference(speaker=voice.speaker, codes=voice.codes, ref_ids=self._ids(reference_text(voice.ref_text)))
