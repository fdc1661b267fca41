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
import ctypes
import ctypes.util
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.sampling_params import has_lone_surrogate

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M], precheck: Callable[[Any], None] | None = None) -> M:
    """`precheck(decoded JSON)` may refuse a body by its size before pydantic builds objects for
    it (pydantic validates in one call that holds the GIL: 600k messages stall the loop for seconds)."""
    raw = await request.body()
    return await asyncio.to_thread(_parse, raw, model, precheck)


def _parse(raw: bytes, model: type[M], precheck: Callable[[Any], None] | None) -> M:
    value = decode_json(raw)
    if precheck is not None:
        precheck(value)
    try:
        return model.model_validate(value)
    except ValidationError as e:  # the app's handler turns it into a 400 naming the field
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


def decode_json(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        # msgspec refuses every lone surrogate, so what it decodes is valid Unicode throughout.
        return msgspec.json.decode(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # It calls a lone surrogate escape "truncated"; `json` reads it, so the message can
        # name the field instead.
        error = e
    value = _decode_with_json(raw, error)
    path = _first_lone_surrogate(value)
    if path is not None:
        raise APIError(400, f"{path or 'body'}: the text is not valid Unicode (it holds a lone surrogate)",
                       param=path or None)
    raise APIError(400, f"the body is not valid JSON: {error}")


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


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    The many small objects of a large JSON body are freed after the request, but glibc keeps
    the pages: without this, one 20 MB body leaves the server hundreds of MB larger. Called by
    app.BodyLimitMiddleware once a large request has been answered."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
