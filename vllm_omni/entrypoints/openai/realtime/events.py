"""Server events of the realtime API (OpenAI Realtime GA shapes), as the JSON the socket sends.

Each event gets a fresh `event_id`; `error` events echo the client's `event_id` inside `error`.
"""
from __future__ import annotations

import itertools
from typing import Any

from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError

_counter = itertools.count(1)


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": f"event_{next(_counter)}", **fields}


def error(err: ProtocolError) -> dict[str, Any]:
    return event("error", error={"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                                 "event_id": err.event_id})


def response_object(response_id: str, conversation_id: str, status: str, modalities: tuple[str, ...],
                    voice: str | None, max_output_tokens: int | None, metadata: dict[str, str] | None,
                    output: list[dict[str, Any]] | None = None, status_details: dict[str, Any] | None = None,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"object": "realtime.response", "id": response_id, "status": status, "status_details": status_details,
            "output": output or [], "conversation_id": conversation_id, "output_modalities": list(modalities),
            "max_output_tokens": "inf" if max_output_tokens is None else max_output_tokens,
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": voice}},
            "usage": usage, "metadata": metadata}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"total_tokens": prompt_tokens + output_tokens, "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "input_token_details": {"cached_tokens": cached_tokens},
            "output_token_details": {"text_tokens": output_tokens}}
