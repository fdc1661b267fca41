"""Server-wide options of chat requests, from vLLM's and upstream's serve flags.

    --chat-template PATH_OR_TEMPLATE     the Jinja template that replaces the model's
    --limit-mm-per-prompt '{"image": 2}' media items one request may carry (400 beyond)
    --audio-stream-shape upstream        streamed audio in `delta.content` (upstream vLLM-Omni)

Each is read and checked once, when the server starts (a bad template or limit stops it before
any model loads); requests only look the values up. Importing this module is light (the CLI
parses its flags with it before anything heavy loads).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MEDIA_KINDS = ("image", "audio", "video")
# Content part type -> the media kind it counts as (chat_parts.py reads the same parts).
_PART_KINDS = {"image_url": "image", "image": "image", "input_audio": "audio", "audio_url": "audio",
               "audio": "audio", "video_url": "video", "video": "video"}
AudioStreamShape = Literal["openai", "upstream"]


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None  # the template text
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)  # kind -> most items (absent: no limit)
    # "openai": streamed audio in `delta.audio.data` (OpenAI's shape, the default); "upstream":
    # in `delta.content`, the shape clients written for upstream vLLM-Omni read (chunks carry
    # `modality: "audio"` either way).
    audio_stream_shape: AudioStreamShape = "openai"

    def check_media_count(self, messages: list[dict[str, Any]]) -> None:
        """400 for a request with more media of a kind than --limit-mm-per-prompt allows."""
        from vllm_omni.entrypoints.openai.errors import APIError

        if not self.limit_mm_per_prompt:
            return
        counts = dict.fromkeys(MEDIA_KINDS, 0)
        for message in messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else ():
                kind = _PART_KINDS.get(part.get("type")) if isinstance(part, Mapping) else None
                if kind is not None:
                    counts[kind] += 1
        for kind, limit in self.limit_mm_per_prompt.items():
            if counts[kind] > limit:
                raise APIError(400, f"at most {limit} {kind}(s) may be provided in one prompt, got {counts[kind]} "
                                    "(--limit-mm-per-prompt)", param="messages")


def load_chat_template(value: str) -> str:
    """--chat-template: a file holding the template, or the template itself (vLLM's rule).
    ValueError for a missing file or a template that does not compile."""
    import jinja2.sandbox

    path = Path(value).expanduser()
    looks_like_template = any(c in value for c in "{}\n")
    if not looks_like_template:
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template {str(path)!r} looks like a file path but cannot be read: "
                             f"{e.strerror}") from None
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return value


def parse_mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON, a count per kind ({"image": 2}) or newer vLLM's
    {"image": {"count": 2, ...}} (only the count is used)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object such as \'{"image": 2, "video": 1}\'')
    limits = {}
    for kind, limit in value.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if kind not in MEDIA_KINDS:
            raise argparse.ArgumentTypeError(f"unknown modality {kind!r}; allowed: {', '.join(MEDIA_KINDS)}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise argparse.ArgumentTypeError(f"{kind}: the limit must be a count >= 0, got {limit!r}")
        limits[kind] = count
    return limits
