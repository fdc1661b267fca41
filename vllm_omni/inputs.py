"""Prompt shapes accepted by `Omni` / `AsyncOmni` and returned by stage input processors.

They are TypedDicts (vLLM's shape), so a user's plain dict prompt and the
`OmniTokensPrompt(prompt_token_ids=..., additional_information=...)` a bridge builds
(spec 003) are the same kind of object.

A user prompt is one of (see docs/architecture.md, "Omni prompts and modalities"):
- `"text"` or `{"prompt": "text"}`: tokenized as is (vLLM's semantics: no chat template);
- `{"prompt_token_ids": [...]}`;
- `{"messages": [...chat messages...]}`: the stage-0 model's input processor applies the chat
  template, loads the media parts and builds the model's inputs;
- `{"prompt": "text with placeholders", "multi_modal_data": {"image": ..., "audio": ...}}`.
Dict prompts may add `mm_processor_kwargs` (e.g. `use_audio_in_video`) and `speaker` (the voice).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, Union

from typing_extensions import NotRequired, Required  # typing has them from 3.11 only


class TextPrompt(TypedDict, total=False):
    prompt: Required[str]
    multi_modal_data: NotRequired[dict[str, Any] | None]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    speaker: NotRequired[str | None]
    additional_information: NotRequired[dict[str, Any] | None]  # e.g. processed media, a voice
    negative_prompt: NotRequired[str | None]  # diffusion models: what the image should not show


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: Required[list[int]]
    prompt: NotRequired[str]  # the text the ids came from, reported back in outputs
    multi_modal_data: NotRequired[dict[str, Any] | None]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    speaker: NotRequired[str | None]


class ChatPrompt(TypedDict, total=False):
    """OpenAI-style chat messages; content is a string or a list of text / media parts.
    `chat_template` replaces the model's template, `chat_template_kwargs` are extra template
    variables (vLLM's request fields)."""

    messages: Required[list[dict[str, Any]]]
    chat_template: NotRequired[str | None]
    chat_template_kwargs: NotRequired[dict[str, Any] | None]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    speaker: NotRequired[str | None]
    additional_information: NotRequired[dict[str, Any] | None]


class OmniTokensPrompt(TokensPrompt, total=False):
    """A stage's input built from upstream outputs (spec 003), or a user prompt after input
    processing (then `additional_information` holds the stage-0 model's inputs and the voice).

    `additional_information` carries per-request payloads to the next stage: tensors
    travel as zero-copy frames or shared memory, other values must be msgpack data
    (numbers, strings, lists, dicts). AR stages understand `prompt_embeds` (a [P, H]
    tensor replacing the prompt's token embeddings); other keys go to the stage model.
    """

    additional_information: NotRequired[dict[str, Any] | None]


PromptType = Union[str, TextPrompt, TokensPrompt, ChatPrompt, OmniTokensPrompt]

# Text-to-speech voice options (Qwen3-TTS, see docs/tts.md); the model's input processor checks them.
TTS_KEYS = ("instructions", "language", "task_type", "ref_audio", "ref_text", "x_vector_only_mode",
            "non_streaming_mode", "cloned_voice", "text_complete", "max_frames_per_token")
_OPTIONAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "speaker", "additional_information",
                  "negative_prompt", *TTS_KEYS)
_TEMPLATE_KEYS = ("chat_template", "chat_template_kwargs")  # with "messages" only
_ALLOWED_KEYS = frozenset({"prompt", "prompt_token_ids", "messages", *_OPTIONAL_KEYS, *_TEMPLATE_KEYS})
# apply_chat_template's own arguments: chat_template_kwargs are template variables, not these.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def parse_prompt(prompt: Any) -> OmniTokensPrompt | TextPrompt | ChatPrompt:
    """Validate the shape of one user prompt; a string becomes a TextPrompt. Raises ValueError.

    Only shapes are checked here; what the keys mean for a model (media, kwargs, voices) is
    the input processor's business (vllm_omni.multimodal.input_processors)."""
    if isinstance(prompt, str):
        return TextPrompt(prompt=prompt)
    if not isinstance(prompt, Mapping):
        raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
    unknown = sorted(set(prompt) - _ALLOWED_KEYS)
    if unknown:
        raise ValueError(f"prompt has unknown key(s) {unknown}; allowed: {sorted(_ALLOWED_KEYS)}")
    for key in ("additional_information", "multi_modal_data", "mm_processor_kwargs", "chat_template_kwargs"):
        value = prompt.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a dict, got {type(value).__name__}")
    _check_template_keys(prompt)
    speaker = prompt.get("speaker")
    if speaker is not None and not isinstance(speaker, str):
        raise ValueError(f"speaker must be a voice name (a string), got {type(speaker).__name__}")
    sources = [k for k in ("prompt_token_ids", "messages") if k in prompt]
    if len(sources) > 1 or ("messages" in prompt and "prompt" in prompt):
        raise ValueError("a prompt has one of 'prompt', 'prompt_token_ids' or 'messages', not several "
                         "('prompt' may accompany 'prompt_token_ids' as the text the ids came from)")
    out: dict[str, Any]
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        out = {"prompt_token_ids": [int(t) for t in ids]}
        if prompt.get("prompt") is not None:
            out["prompt"] = prompt["prompt"]
    elif "messages" in prompt:
        messages = prompt["messages"]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        if "multi_modal_data" in prompt:
            raise ValueError("with 'messages', media go in the message content parts, not multi_modal_data")
        out = {"messages": list(messages)}
        out.update({k: prompt[k] for k in _TEMPLATE_KEYS if prompt.get(k) is not None})
    else:
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("a dict prompt needs 'prompt' (a string), 'prompt_token_ids' or 'messages'")
        out = {"prompt": prompt["prompt"]}
    for key in _OPTIONAL_KEYS:
        if prompt.get(key) is not None:
            out[key] = prompt[key]
    return out  # type: ignore[return-value]


def _check_template_keys(prompt: Mapping[str, Any]) -> None:
    given = [k for k in _TEMPLATE_KEYS if prompt.get(k) is not None]
    if given and "messages" not in prompt:
        raise ValueError(f"{given[0]} applies to chat 'messages' prompts only")
    template = prompt.get("chat_template")
    if template is not None and not (isinstance(template, str) and template.strip()):
        raise ValueError("chat_template must be a non-empty string (a Jinja template)")
    if reserved := sorted(set(prompt.get("chat_template_kwargs") or {}) & _RESERVED_TEMPLATE_KWARGS):
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they are arguments of "
                         "apply_chat_template itself, not template variables")


def needs_input_processing(prompt: Mapping[str, Any]) -> bool:
    """Whether a parsed prompt needs the model's input processor (more than a tokenizer)."""
    return any(prompt.get(k) is not None for k in ("messages", "multi_modal_data", "mm_processor_kwargs", "speaker",
                                                    *TTS_KEYS))


__all__ = ["ChatPrompt", "TextPrompt", "TokensPrompt", "OmniTokensPrompt", "PromptType", "needs_input_processing",
           "parse_prompt"]
