"""The FastAPI app: OpenAI-compatible routes over one AsyncOmni, plus health, version, metrics.

    app = build_app(ctx, api_key="secret")   # ctx: serving_base.ServingContext

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/audio/speech (text-to-speech
models) and its WebSocket /v1/audio/speech/stream (text in as it is written), POST
/v1/images/generations and /v1/images/edits (diffusion models), /v1/videos (video models: create,
list, retrieve, content, delete), GET / POST /v1/audio/voices and GET / DELETE
/v1/audio/voices/{name}, GET /v1/models, GET /health (503 naming each stage that is down), GET
/version, GET /metrics (Prometheus text format); with --enable-sleep-mode POST /sleep, POST /wake_up
and GET /is_sleeping (sleep_routes.py); the realtime WebSocket GET /v1/realtime, POST
/v1/audio/transcriptions and /v1/audio/translations, and the voice-chat page at / (static files
under /static).
With an API key, every /v1 route needs `Authorization: Bearer <key>` (401 otherwise), as in
vLLM; health, version and metrics stay open for probes and scrapers.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_omni.engine.stage_client import StageState
from vllm_omni.version import __version__
from vllm_omni.entrypoints.openai.access_log import log_access
from vllm_omni.entrypoints.openai.errors import APIError, ClientDisconnected, install_error_handlers, retry_after
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_omni.entrypoints.openai.request_body import parse_body, release_free_memory
from vllm_omni.entrypoints.openai.serving_base import ServingContext, summarize_reason
from vllm_omni.entrypoints.openai.serving_chat import ChatService
from vllm_omni.entrypoints.openai.serving_completions import CompletionService
from vllm_omni.entrypoints.openai.realtime.endpoint import RealtimeEndpoint, model_abilities
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.serving_images import ImageRequest, ImageService
from vllm_omni.entrypoints.openai.serving_speech import (
    DEFAULT_MAX_INSTRUCTIONS, SpeechRequest, SpeechService,
)
from vllm_omni.entrypoints.openai.serving_speech_batch import BatchSpeechRequest, SpeechBatchService
from vllm_omni.entrypoints.openai.serving_transcription import TranscriptionService
from vllm_omni.entrypoints.openai.serving_video import VideoService, add_video_routes
from vllm_omni.entrypoints.openai.serving_voices import VoicesService
from vllm_omni.entrypoints.openai.sleep_routes import add_sleep_routes
from vllm_omni.entrypoints.openai.speech_stream import SpeechStreamEndpoint
from vllm_omni.entrypoints.openai.tts_limits import SpeechBatchLimits, SpeechStreamLimits, VoiceLimits
from vllm_omni.entrypoints.openai.video_store import VideoStoreOptions
from vllm_omni.model_executor.models.families import speech_model

TRIM_AFTER_BYTES = 1024 * 1024  # bodies this large leave enough freed heap to be worth a malloc_trim
STATIC_DIR = Path(__file__).resolve().parent / "static"  # the voice-chat page (package data)
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics",
           "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech", "/v1/audio/voices",
           "/v1/audio/speech/stream", "/v1/images/generations", "/v1/images/edits", "/v1/videos", "/sleep",
           "/wake_up", "/is_sleeping")


class StatusMetricsMiddleware:
    """Counts every request by route and final status, and writes its access-log line. A stream
    reports its outcome (an in-band error, a disconnect) through request.state.final_status,
    since its HTTP status is sent first."""

    def __init__(self, app: ASGIApp, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception that escapes every handler
        started = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            final = scope.get("state", {}).get("final_status") or status
            path = scope.get("path", "")
            self.ctx.metrics.observe_status(path if path in _ROUTES else "other", final)
            log_access(scope, final, time.monotonic() - started)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            # Constant-time comparison: the key must not leak through response timing.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')").response()(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before it is buffered: by its Content-Length,
    or while a chunked body arrives (the JSON of inline base64 media can be huge)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI passes an HTTPException out of its body reading unchanged (any
                    # other exception would become a 400 "error parsing the body").
                    raise StarletteHTTPException(413, self._too_large().message)
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if seen >= TRIM_AFTER_BYTES:  # the body's objects are gone now: return their pages
                await asyncio.to_thread(release_free_memory)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over the {self.max_bytes} byte limit (--max-request-bytes)")


def build_app(ctx: ServingContext, api_key: str | None = None, max_request_bytes: int = 64 * 1024 * 1024,
              realtime: RealtimeLimits | None = None,
              tts_max_instructions_length: int = DEFAULT_MAX_INSTRUCTIONS, video: VideoStoreOptions | None = None,
              voice_limits: VoiceLimits | None = None, speech_stream: SpeechStreamLimits | None = None,
              speech_batch: SpeechBatchLimits | None = None) -> FastAPI:
    app = FastAPI(title="vllm-omni", version=__version__)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    chat, completions = ChatService(ctx), CompletionService(ctx)
    created = int(time.time())

    # Bodies are parsed off the event loop (request_body.py), not by FastAPI on it.
    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Any:
        return await chat.create(await parse_body(raw, ChatCompletionRequest, ctx.precheck_chat), raw)

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Any:
        return await completions.create(await parse_body(raw, CompletionRequest, ctx.precheck_completion), raw)

    abilities = model_abilities(ctx)
    tts = speech_model(ctx.model_path)  # None: the served model does not speak text
    voices = VoicesService(ctx.model_path, tts, list(tts.voices if tts else abilities.voices),
                           voice_limits or VoiceLimits(), tts_max_instructions_length, ctx.media)
    voices.open()  # the folder's voices into memory (a Base checkpoint: its encoders' fingerprint first)
    speech = SpeechService(ctx, tts, voices, tts_max_instructions_length)

    @app.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest, raw: Request) -> Any:
        return await speech.create(body, raw)

    speech_batches = SpeechBatchService(speech, (speech_batch or SpeechBatchLimits()).max_items)

    @app.post("/v1/audio/speech/batch")
    async def create_speech_batch(body: BatchSpeechRequest, raw: Request) -> dict[str, Any]:
        return await speech_batches.create(body, raw)

    speech_socket = SpeechStreamEndpoint(ctx, speech, realtime or RealtimeLimits(), speech_stream or SpeechStreamLimits(),
                                         api_key)
    app.add_api_websocket_route("/v1/audio/speech/stream", speech_socket)
    # The `openai` SDK's realtime client connects to <base_url>/realtime: with base_url
    # .../v1/audio/speech/stream it reaches the same socket (docs/tts.md).
    app.add_api_websocket_route("/v1/audio/speech/stream/realtime", speech_socket)

    @app.get("/v1/audio/voices")
    async def list_voices() -> dict[str, Any]:
        return voices.list()

    @app.post("/v1/audio/voices")
    async def create_voice(raw: Request) -> dict[str, Any]:  # multipart: parsed by the service
        return await voices.create(raw)

    @app.get("/v1/audio/voices/{name}")
    async def get_voice(name: str) -> dict[str, Any]:
        return voices.get(name)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> dict[str, Any]:
        return voices.delete(name)

    images = ImageService(ctx)

    @app.post("/v1/images/generations")
    async def create_image(body: ImageRequest, raw: Request) -> Any:
        return await images.generate(body, raw)

    @app.post("/v1/images/edits")
    async def edit_image(raw: Request) -> Any:  # multipart: parsed by the service
        return await images.edit(raw)

    add_video_routes(app, VideoService(ctx, video or VideoStoreOptions()))  # /v1/videos (serving_video.py)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": created, "owned_by": "vllm-omni",
                 "root": ctx.model_path, "parent": None, "output_modalities": ctx.shape.modalities()}
                for name in ctx.served_names]
        return {"object": "list", "data": data}

    app.add_api_websocket_route("/v1/realtime", RealtimeEndpoint(ctx, abilities, realtime or RealtimeLimits(), api_key))
    transcription = TranscriptionService(ctx)

    @app.post("/v1/audio/transcriptions")
    async def create_transcription(raw: Request) -> Response:
        return await transcription.create(raw, "transcribe")

    @app.post("/v1/audio/translations")
    async def create_translation(raw: Request) -> Response:
        return await transcription.create(raw, "translate")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def voice_chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.shutting_down:  # load balancers: stop sending requests here
            return APIError(503, "the server is shutting down").response()
        health = ctx.engine.stage_health()
        stages = [{"stage_id": h.stage_id, "model_stage": h.model_stage, "state": h.state.value,
                   "reason": h.reason, "pid": h.pid, "retry_after_s": h.retry_after_s,
                   "replicas": [{"replica": r.replica, "pid": r.pid, "state": r.state.value, "queue": r.queue,
                                 "routed": r.routed, "reason": r.reason} for r in h.replicas]} for h in health]
        down = [h for h in health if h.state != StageState.UP]
        if not down:
            return JSONResponse({"status": "ok", "stages": stages})
        what = "; ".join(f"stage {h.stage_id}{f' ({h.model_stage})' if h.model_stage else ''} is {h.state.value}: "
                         f"{summarize_reason(h.reason)}" for h in down)
        error = APIError(503, f"unhealthy: {what}", retry_after_s=retry_after(down))
        return JSONResponse({**error.body(), "stages": stages}, status_code=503, headers=error.headers())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await ctx.metrics.render(ctx.engine, ctx.gate), media_type=CONTENT_TYPE_LATEST)

    if ctx.engine.sleep_mode:  # vLLM's /sleep, /wake_up, /is_sleeping (else 404, as without dev mode)
        add_sleep_routes(app, ctx)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # checked before the body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # Added last, so it is the outermost layer: it also counts the 401s of the key check.
    app.add_middleware(StatusMetricsMiddleware, ctx=ctx)
    return app
