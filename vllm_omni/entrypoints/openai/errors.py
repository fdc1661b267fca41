"""Errors in OpenAI's JSON shape, with the HTTP status each kind of failure deserves.

    raise APIError(400, "messages must not be empty", param="messages")
    -> 400 {"error": {"message": "...", "type": "BadRequestError", "param": "messages", "code": 400}}

Statuses (DESIGN 7.6): 400 invalid input, 401 bad API key, 404 unknown model or route,
413 input too long, 429 admission limit reached, 500 one request failed inside the server or
a stage, 503 a stage the request needs is down. The official `openai` client maps each status
to its exception class, so the status matters more than the `type` string (vLLM's names).
"""
from __future__ import annotations

import logging
import math
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.engine.stage_client import StageHealth, StageState

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# The engine ends a request whose prompt leaves no room for output with this wording
# (llm_engine.add_request). It is the only stage failure that is the client's fault by size.
_PROMPT_TOO_LONG = re.compile(r"the prompt has \d+ tokens, which does not leave room")
# A request's own max_tokens that does not fit after its prompt (llm_engine.max_tokens_too_large).
_MAX_TOKENS_TOO_LARGE = re.compile(r"'max_tokens' or 'max_completion_tokens' is too large")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s  # sent as Retry-After (a stage is restarting)

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


class ClientDisconnected(Exception):
    """The client went away; the request was aborted in every stage."""


def from_request_failure(stage_id: int | None, message: str, health: list[StageHealth]) -> APIError:
    """A request that failed in the pipeline -> 503 (its stage is down), 413 (too long) or 500."""
    by_id = {h.stage_id: h for h in health}
    failed = by_id.get(stage_id) if stage_id is not None else None
    down = [h for h in health if h.state != StageState.UP]
    if (failed is not None and failed.state != StageState.UP) or (failed is None and down):
        return APIError(503, message, retry_after_s=retry_after([failed] if failed is not None else down))
    if failed is not None and any(r.state != StageState.UP for r in failed.replicas):
        return APIError(503, message)  # a replica of the stage died with it; the others serve: retry now
    if _PROMPT_TOO_LONG.search(message):
        return APIError(413, message)
    if _MAX_TOKENS_TOO_LARGE.search(message):
        return APIError(400, message, param="max_tokens")
    return APIError(500, message)


def retry_after(down: list[StageHealth]) -> float | None:
    """When every stage in `down` should serve again (None: one of them is not coming back)."""
    waits = [h.retry_after_s for h in down]
    return None if not waits or None in waits else max(waits)  # type: ignore[type-var]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's error list -> one readable line and the first offending parameter."""
    errors = list(exc.errors())
    # A content part with an unknown type fails every branch of the union; only the tag
    # mismatch says what is wrong.
    tagged = [e for e in errors if e.get("type") == "union_tag_invalid"]
    locs = [_location(e) for e in errors]
    # A union (`content: str | list[part]`) reports every branch; the branch that got deeper
    # into the value says what is wrong, not "should be a valid string".
    errors = [e for e, loc in zip(errors, locs) if not any(o != loc and o[:len(loc)] == loc for o in locs)]
    parts, first = [], None
    for err in tagged or errors:
        where = ".".join(_location(err)) or "body"
        first = first or where
        kind = err.get("type")
        if kind == "extra_forbidden":
            parts.append(f"unsupported parameter {where!r}")
        elif kind == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            first = None
        elif kind == "union_tag_invalid":
            ctx = err.get("ctx", {})
            parts.append(f"{where}: unknown content part type {ctx.get('tag')!r}; expected one of "
                         f"{ctx.get('expected_tags')}")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", first


def _location(err: dict[str, Any]) -> tuple[str, ...]:
    """pydantic's loc without its bookkeeping: the body prefix, union branch names, and a
    discriminated part's tag (loc [..., 0, "input_audio", "input_audio", "format"], or
    [..., 0, "image_url", "image"] for an unknown key "image" of the part)."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "str")
           and not str(p).startswith(("tagged-union", "list[", "function-"))]
    # After `content.<i>` comes the part's tag, not a key of the part: dropped.
    return tuple(p for i, p in enumerate(loc) if not (i >= 2 and loc[i - 2] == "content" and loc[i - 1].isdigit()))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI (and its clients) expect 400 for a malformed request.
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
