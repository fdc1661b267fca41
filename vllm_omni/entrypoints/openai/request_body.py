"""Read, parse and validate a JSON request body without stalling the event loop.

    body = await parse_body(request, ChatCompletionRequest)   # APIError 400 / 413, or the model

FastAPI would parse the JSON and run pydantic on the event loop: a 20 MB body (or one with
half a million messages) holds every other request for seconds. Here the body is read with
the size limit counted as it arrives (`app.BodyLimitMiddleware`), then decoded (msgspec, about
twice as fast as `json`) and validated in a worker thread.

Refused with 400 and the field named: bytes that are not JSON, NaN / Infinity literals,
numbers out of range, nesting deeper than the parser allows, and strings that are not valid
Unicode (a lone surrogate such as "\\ud800" would otherwise reach a tokenizer and fail there).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.sampling_params import has_lone_surrogate

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    return await asyncio.to_thread(_parse, raw, model)


def _parse(raw: bytes, model: type[M]) -> M:
    value = decode_json(raw)
    try:
        return model.model_validate(value)
    except ValidationError as e:  # the app's handler turns it into a 400 naming the field
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


def decode_json(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as first:
        # msgspec calls a lone surrogate escape "truncated"; `json` reads it, so the
        # message can name the field instead.
        value = _decode_with_json(raw, first)
    path = _first_lone_surrogate(value)
    if path is not None:
        raise APIError(400, f"{path or 'body'}: the text is not valid Unicode (it holds a lone surrogate)",
                       param=path or None)
    return value


def _decode_with_json(raw: bytes, first: Exception) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = e if isinstance(e, json.JSONDecodeError) or "JSON number" in str(e) else first
        raise APIError(400, f"the body is not valid JSON: {reason}") from None


def _first_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and has_lone_surrogate(key):
                    return where or "body"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{where}.{i}") for i, child in enumerate(item))
    return None
