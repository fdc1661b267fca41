"""Split chat messages into what the chat template renders and the media items they carry.

Accepted content parts (OpenAI-style, the HF chat-template style, and raw objects):
  text:  "a string" | {"type": "text", "text": ...}
  image: PIL.Image | HxWx3 array | {"type": "image", "image": src} | {"type": "image_url",
         "image_url": {"url": src}} (or a plain string) | {"type": "image", "url"/"path": src}
  audio: (waveform, sample_rate) | 1-D array | {"type": "audio", "audio": src} |
         {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}} |
         {"type": "audio_url", "audio_url": {"url": src}}
  video: [T, H, W, 3] array | {"type": "video", "video": src or [frames]} |
         {"type": "video_url", "video_url": {"url": src}}
A src is anything media.read_source takes (URL, data URL, path, bytes). Image parts may carry
min_pixels / max_pixels; video parts any VideoSampling field (fps, num_frames, max_pixels...),
next to the source or inside a `video_url` object (vLLM's `{"url": ..., "num_frames": 16}`).
A part holds exactly one source and no other keys: `{"type": "image_url", "image_url": ...,
"image": ...}` is refused, not read from whichever key wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni.multimodal.media import MediaError, decode_base64
from vllm_omni.multimodal.vision import VideoSampling

MODALITIES = ("image", "audio", "video")
_TYPE_TO_KIND = {
    "image": "image", "image_url": "image",
    "audio": "audio", "input_audio": "audio", "audio_url": "audio",
    "video": "video", "video_url": "video",
}
# Keys holding the data, by priority, for each kind (the first present one is used).
_SOURCE_KEYS = {
    "image": ("image", "image_url", "url", "path"),
    "audio": ("audio", "input_audio", "audio_url", "url", "path"),
    "video": ("video", "video_url", "url", "path"),
}
_OPTION_KEYS = {
    "image": frozenset({"min_pixels", "max_pixels"}),
    "audio": frozenset(),
    "video": frozenset(VideoSampling.__dataclass_fields__) - {"frame_factor", "image_factor"},
}


@dataclass
class MediaItem:
    kind: str  # "image" | "audio" | "video"
    source: Any
    options: dict[str, Any] = field(default_factory=dict)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("torch")


def _raw_object(part: Any) -> MediaItem | None:
    """A bare object as a content part: its kind follows from its type and shape."""
    from PIL import Image

    if isinstance(part, Image.Image):
        return MediaItem("image", part)
    if isinstance(part, tuple) and len(part) == 2 and _is_array(part[0]):
        return MediaItem("audio", part)
    if _is_array(part):
        kind = {1: "audio", 2: "audio", 3: "image", 4: "video"}.get(part.ndim)
        if kind is None:
            raise MediaError(f"cannot tell the modality of a {part.ndim}-D array")
        if kind == "image" and type(part).__module__.startswith("torch"):
            raise MediaError("pass images as PIL images or HxWx3 uint8 numpy arrays")
        return MediaItem(kind, part)
    return None


def _unwrap(kind: str, key: str, value: Any) -> Any:
    if key == "input_audio":  # OpenAI: {"data": <base64, no data: prefix>, "format": "wav"}
        if not isinstance(value, Mapping) or not isinstance(value.get("data"), str):
            raise MediaError("input_audio must be {'data': <base64>, 'format': ...}")
        return decode_base64(value["data"], "input_audio data")
    if key.endswith("_url") and isinstance(value, Mapping):  # {"url": ..., "detail": ...}
        if "url" not in value:
            raise MediaError(f"{key} must be a string or {{'url': ...}}")
        return value["url"]
    return value


def classify_part(part: Any) -> str | MediaItem:
    """A content part -> its text (a str) or a MediaItem. Raises MediaError when unusable."""
    if isinstance(part, str):
        return part
    item = _raw_object(part)
    if item is not None:
        return item
    if not isinstance(part, Mapping):
        raise MediaError(f"unsupported content part of type {type(part).__name__}")
    ptype = part.get("type")
    if ptype == "text" or (ptype is None and "text" in part):
        text = part.get("text")
        if not isinstance(text, str):
            raise MediaError("a text part needs 'text' (a string)")
        return text
    kind = _TYPE_TO_KIND.get(ptype) if ptype is not None else next(
        (_TYPE_TO_KIND[k] for k in _TYPE_TO_KIND if k in part), None
    )
    if kind is None:
        raise MediaError(f"unsupported content part type {ptype!r}")
    keys = [k for k in _SOURCE_KEYS[kind] if part.get(k) is not None]
    if len(keys) != 1:
        raise MediaError(f"the {ptype or kind} part has " + (f"{len(keys)} sources {keys}; give exactly one" if keys
                         else f"no data (expected one of {_SOURCE_KEYS[kind]})"))
    unknown = sorted(set(part) - {"type", *_SOURCE_KEYS[kind], *_OPTION_KEYS[kind]})
    if unknown:
        raise MediaError(f"unknown key(s) {unknown} in the {ptype or kind} part; allowed besides its source: "
                         f"{sorted(_OPTION_KEYS[kind])}")
    key = keys[0]
    options = {k: part[k] for k in _OPTION_KEYS[kind] if part.get(k) is not None}
    if key.endswith("_url") and isinstance(part[key], Mapping):  # {"url": ..., "num_frames": 16}
        options.update({k: v for k, v in part[key].items() if k in _OPTION_KEYS[kind] and v is not None})
    return MediaItem(kind, _unwrap(kind, key, part[key]), options)


def parse_messages(messages: Any) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """-> (messages for the chat template, media items in prompt order).

    Template parts are reduced to {"type": "text", "text": ...} and {"type": <kind>}: the
    template only needs to know where media go, and the released template has no branch for
    "video_url" / "input_audio" parts (they would silently vanish from the prompt).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MediaError("messages must be a non-empty list")
    rendered, items = [], []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise MediaError("each message must be a dict with a 'role' string")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            rendered.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            content = [content]  # a single part (e.g. a bare image)
        parts = []
        for part in content:
            parsed = classify_part(part)
            if isinstance(parsed, str):
                parts.append({"type": "text", "text": parsed})
            else:
                parts.append({"type": parsed.kind})
                items.append(parsed)
        rendered.append({"role": message["role"], "content": parts})
    return rendered, items


def items_from_multi_modal_data(data: Mapping[str, Any] | None) -> list[MediaItem]:
    """vLLM-style {"image": x or [x, ...], "audio": ..., "video": ...} -> MediaItems.

    The order across modalities does not matter: each modality's items fill that modality's
    placeholders in prompt order.
    """
    if not data:
        return []
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise MediaError(f"unknown multi_modal_data key(s) {unknown}; use {list(MODALITIES)}")
    items = []
    for kind in MODALITIES:
        values = data.get(kind)
        if values is None:
            continue
        # A list is several items: a video given as a list of frames must be wrapped, [[frames]].
        values = values if isinstance(values, list) else [values]
        for value in values:
            if isinstance(value, Mapping):
                parsed = classify_part({"type": kind, **value} if "type" not in value else value)
                if isinstance(parsed, str) or parsed.kind != kind:
                    raise MediaError(f"multi_modal_data[{kind!r}] holds a non-{kind} item")
                items.append(parsed)
            else:
                items.append(MediaItem(kind, value))
    return items


def render_chat(tokenizer: Any, messages: list[Any], chat_template: str | None = None,
                add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of chat messages through `chat_template` (None: the tokenizer's) and its
    extra variables. A template that fails to render, or rejects a variable, is bad input."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
