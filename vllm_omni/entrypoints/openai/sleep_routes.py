"""vLLM's sleep mode endpoints, with --enable-sleep-mode (docs/operations.md, "Sleep mode").

    POST /sleep?level=1|2        200, empty body; 409 while requests are in flight
    POST /wake_up[?tags=weights&tags=kv_cache]   200, empty body
    GET  /is_sleeping            {"is_sleeping": true | false}

vLLM serves them in development mode only (VLLM_SERVER_DEV_MODE=1); here they exist when a stage
runs in sleep mode (--enable-sleep-mode, or `enable_sleep_mode` in a stage config), else they are
404 like any unknown route. Like /health and /metrics they are outside /v1, so --api-key does not
cover them: expose them only where operators reach the server.

While the server sleeps, generation requests (every POST under /v1) are answered 503 at once,
before their body is read, with an OpenAI error saying so; /health, /metrics, /v1/models stay up.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_omni.engine.pipeline_sleep import SLEEPING, SleepConflict
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.serving_base import ServingContext
from vllm_omni.worker.sleep_mode import WAKE_TAGS


def add_sleep_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    @app.post("/sleep")
    async def sleep(raw: Request) -> Response:
        level = raw.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 (weights kept in CPU memory) or 2 (weights dropped), got {level!r}",
                           param="level")
        try:
            await engine.sleep(int(level))
        except SleepConflict as e:
            raise APIError(409, str(e)) from None
        except RuntimeError as e:  # a stage failed to sleep: the others were woken again
            raise APIError(500, str(e)) from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw: Request) -> Response:
        tags = raw.query_params.getlist("tags") or None
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if unknown:
            raise APIError(400, f"unknown tags {unknown}; tags are {list(WAKE_TAGS)}", param="tags")
        try:
            await engine.wake_up(tags)
        except RuntimeError as e:  # e.g. no device memory to build a stage's engine in: it sleeps on
            raise APIError(503, str(e)) from None
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    app.add_middleware(SleepingGate, ctx=ctx)


class SleepingGate:
    """503 for generation requests while the server sleeps, before anything reads their body."""

    def __init__(self, app: ASGIApp, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path", "").startswith("/v1/")
                and await self.ctx.engine.is_sleeping()):
            await APIError(503, SLEEPING).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
