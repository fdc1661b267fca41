"""User prompt -> the entry stage's input, by the stage-0 model architecture.

    processor = get_input_processor(model_dir, hf_config, tokenizer, media=policy)
    prompt = processor.process(parse_prompt(user_prompt))   # OmniTokensPrompt; ValueError on bad input

It runs in the caller's process (Omni / AsyncOmni / the API server), before anything is
queued, so bad media is a ValueError (HTTP 400) and never reaches a stage. A plain LLM gets
a tokenizer and its chat template; Qwen2.5-Omni and Qwen3-Omni get their processors (chat
template, media loading, placeholder expansion, features), and the result's `additional_information` holds
the thinker's `model_inputs` (flat tensors) plus `speaker`: the thinker reads the features
(`embed_request_span`), the thinker2talker bridge reads the grids and the voice.

`process` may run in several threads at once (one per request): each processor keeps its
tokenizer under a lock of its own and reads and decodes media outside it, under its
`MediaPolicy` (media_policy.py: TRUSTED for the offline APIs, the server's policy behind it).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.multimodal.media_policy import TRUSTED, MediaPolicy

USE_AUDIO_IN_VIDEO = "use_audio_in_video"
SPEAKER = "speaker"


class InputProcessor(Protocol):
    def process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        """A parsed prompt (inputs.parse_prompt) -> the entry stage's input. Raises ValueError."""
        ...


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("no stage has is_comprehension: true, so text prompts cannot be tokenized; "
                         "pass {'prompt_token_ids': [...]}")
    # vLLM's rule for raw prompts: tokenized as is. Chat templates carry their own special tokens.
    return tokenizer.encode(text, add_special_tokens=False)


def _base(prompt: Mapping[str, Any], ids: list[int], text: str | None, info: dict[str, Any]) -> OmniTokensPrompt:
    if prompt.get("negative_prompt") is not None:
        raise ValueError("negative_prompt is for diffusion models; this model generates text")
    out = OmniTokensPrompt(prompt_token_ids=list(ids))
    if text is not None:
        out["prompt"] = text
    user_info = dict(prompt.get("additional_information") or {})
    if user_info or info:
        out["additional_information"] = {**user_info, **info}
    return out


class TextInputProcessor:
    """A text-only model: raw prompts tokenized as is, chat messages through the chat template."""

    def __init__(self, tokenizer: Any, model_name: str = "this model") -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.text_lock = threading.Lock()

    def process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        with self.text_lock:  # text only: all of it is tokenizer work
            return self._process(prompt)

    def _process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        for key, what in (("multi_modal_data", "multimodal data"), ("mm_processor_kwargs", "mm_processor_kwargs"),
                          (SPEAKER, "a speaker (it has no audio output)")):
            if prompt.get(key) is not None:
                raise ValueError(f"{self.model_name} takes no {what}")
        if "prompt_token_ids" in prompt:
            return _base(prompt, prompt["prompt_token_ids"], prompt.get("prompt"), {})
        if "messages" in prompt:
            text = self._render(prompt["messages"], prompt.get("chat_template"), prompt.get("chat_template_kwargs"))
            return _base(prompt, _tokenize(self.tokenizer, text), text, {})
        return _base(prompt, _tokenize(self.tokenizer, prompt["prompt"]), prompt["prompt"], {})

    def _render(self, messages: list[Any], chat_template: str | None, template_kwargs: Mapping[str, Any] | None) -> str:
        from vllm_omni.multimodal.chat_parts import render_chat  # media/vision pull in torch: only when used

        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError(f"{self.model_name} has no chat template: pass a prompt string or token ids")
        rendered = []
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError("each message must be a dict with a 'role' string")
            rendered.append({"role": message["role"], "content": _text_content(message.get("content"),
                                                                                self.model_name)})
        return render_chat(self.tokenizer, rendered, chat_template, template_kwargs=template_kwargs)


def _text_content(content: Any, model_name: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError("message content must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{model_name} takes text only; got a {kind!r} content part")
    return "".join(texts)


class Qwen2_5OmniPromptProcessor:
    """Qwen2.5-Omni: the multimodal processor (vllm_omni.multimodal.qwen2_5_omni_processor)."""

    def __init__(self, model_dir: str | os.PathLike, tokenizer: Any = None, media: MediaPolicy = TRUSTED) -> None:
        from vllm_omni.multimodal.vision import VideoSampling

        self.inner = self._load_inner(model_dir, tokenizer, media)
        self.tokenizer = self.inner.tokenizer
        # Per-request video sampling overrides (fps, max_frames, ...) are mm_processor_kwargs too.
        self.video_keys = frozenset(VideoSampling.__dataclass_fields__) - {"frame_factor", "image_factor"}
        self.speakers = self.speaker_names(Path(model_dir))

    @staticmethod
    def _load_inner(model_dir: str | os.PathLike, tokenizer: Any, media: MediaPolicy) -> Any:
        from vllm_omni.multimodal.qwen2_5_omni_processor import Qwen2_5OmniInputProcessor

        return Qwen2_5OmniInputProcessor.from_pretrained(model_dir, tokenizer=tokenizer, media=media)

    @staticmethod
    def speaker_names(model_dir: Path) -> list[str] | None:
        """The checkpoint's voices (None: a thinker-only checkpoint, which has none)."""
        if not (model_dir / "spk_dict.pt").is_file():
            return None
        from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import load_speakers

        return sorted(load_speakers(model_dir))

    def _known_speaker(self, speaker: str) -> bool:
        return speaker in self.speakers

    def process(self, prompt: Mapping[str, Any]) -> OmniTokensPrompt:
        use_audio_in_video, video_options = self._mm_kwargs(prompt.get("mm_processor_kwargs") or {})
        speaker = prompt.get(SPEAKER)
        if speaker is not None and not isinstance(speaker, str):  # else it would fail in the talker, after the thinker
            raise ValueError(f"speaker must be a voice name (string), got {type(speaker).__name__}")
        if speaker is not None and self.speakers is not None and not self._known_speaker(speaker):
            raise ValueError(f"unknown speaker {speaker!r}; available: {self.speakers}")
        text = None
        if "messages" in prompt:
            result = self.inner.process_messages(prompt["messages"], use_audio_in_video=use_audio_in_video,
                                                 video_options=video_options, chat_template=prompt.get("chat_template"),
                                                 **(prompt.get("chat_template_kwargs") or {}))
        else:
            ids = prompt.get("prompt_token_ids")
            if ids is None:
                text = prompt["prompt"]
                with self.inner.text_lock:
                    ids = _tokenize(self.tokenizer, text)
            else:
                text = prompt.get("prompt")
            # Checks the placeholders against the items even without media (a stray <|IMAGE|>).
            result = self.inner.process_prompt(ids, prompt.get("multi_modal_data"),
                                               use_audio_in_video=use_audio_in_video, video_options=video_options)
        info: dict[str, Any] = dict(result.mm_inputs)
        if result.mm_inputs:
            info[USE_AUDIO_IN_VIDEO] = bool(result.use_audio_in_video)
        if speaker is not None:
            info[SPEAKER] = speaker
        return _base(prompt, result.prompt_token_ids, text, info)

    def _mm_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
        unknown = sorted(set(kwargs) - self.video_keys - {USE_AUDIO_IN_VIDEO})
        if unknown:
            raise ValueError(f"unknown mm_processor_kwargs {unknown}; known: "
                             f"{sorted(self.video_keys | {USE_AUDIO_IN_VIDEO})}")
        flag = kwargs.get(USE_AUDIO_IN_VIDEO, False)
        if not isinstance(flag, bool):
            raise ValueError(f"mm_processor_kwargs.{USE_AUDIO_IN_VIDEO} must be true or false, got {flag!r}")
        video_options = {k: v for k, v in kwargs.items() if k != USE_AUDIO_IN_VIDEO}
        self.inner.video_sampling.updated(video_options)  # bad values fail now, video or not
        return flag, video_options


class Qwen3OmniPromptProcessor(Qwen2_5OmniPromptProcessor):
    """Qwen3-Omni: its own multimodal processor (vllm_omni.multimodal.qwen3_omni_processor),
    the same prompt shapes and mm_processor_kwargs. The voices are codec ids in config.json
    (`talker_config.speaker_id`; there is no spk_dict.pt), matched case-insensitively as
    transformers' generate does (`speaker.lower()`): the talker lowercases the name itself."""

    @staticmethod
    def _load_inner(model_dir: str | os.PathLike, tokenizer: Any, media: MediaPolicy) -> Any:
        from vllm_omni.multimodal.qwen3_omni_processor import Qwen3OmniInputProcessor

        return Qwen3OmniInputProcessor.from_pretrained(model_dir, tokenizer=tokenizer, media=media)

    @staticmethod
    def speaker_names(model_dir: Path) -> list[str] | None:
        """None: a checkpoint without a talker (thinker-only, or a config without voices)."""
        path = model_dir / "config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        voices = (config.get("talker_config") or {}).get("speaker_id")
        return sorted(voices) if isinstance(voices, Mapping) and voices else None

    def _known_speaker(self, speaker: str) -> bool:
        return speaker.lower() in self.speakers


def get_input_processor(model_path: str | os.PathLike, hf_config: Any, tokenizer: Any = None, *,
                        architecture: str | None = None, media: MediaPolicy = TRUSTED) -> InputProcessor:
    """The input processor of the model at `model_path` (its HF config as a dict or a
    PretrainedConfig), named by its family record; a text model without one gets the
    tokenizer and chat template. `architecture` (a stage's `model_arch`) wins over the config's;
    `media`: where media may come from and how much they may decode to."""
    from vllm_omni.imports import import_dotted
    from vllm_omni.model_executor.models.families import family_of

    get = hf_config.get if isinstance(hf_config, Mapping) else lambda key: getattr(hf_config, key, None)
    model_type, archs = get("model_type"), list(get("architectures") or [])
    family = family_of({"model_type": model_type, "architectures": [architecture] if architecture else archs})
    if family is not None and family.input_processor is not None:
        return import_dotted(family.input_processor)(os.fspath(model_path), tokenizer, media=media)
    return TextInputProcessor(tokenizer, model_name=archs[0] if archs else os.fspath(model_path))
