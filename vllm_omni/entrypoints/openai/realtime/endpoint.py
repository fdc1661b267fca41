"""`GET /v1/realtime`: the WebSocket, its authentication, and the bounds of a session.

    endpoint = RealtimeEndpoint(ctx, limits, api_key)
    app.add_api_websocket_route("/v1/realtime", endpoint)

With an API key the client authenticates as with OpenAI: `Authorization: Bearer <key>`, or,
from a browser (which cannot set headers on a WebSocket), the subprotocol
`openai-insecure-api-key.<key>`. A bad key closes the handshake (HTTP 403).
Client events are handled one at a time, in order; a response runs beside them, so the client
can cancel it or talk over it. A socket that drops cancels the session's response, which aborts
its request in every stage.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError, parse_client_event
from vllm_omni.entrypoints.openai.realtime.session import RealtimeSession
from vllm_omni.entrypoints.openai.realtime.session_config import ModelAbilities
from vllm_omni.entrypoints.openai.serving_base import ServingContext
from vllm_omni.entrypoints.openai.voices import model_voices

logger = logging.getLogger(__name__)

KEY_PROTOCOL = "openai-insecure-api-key."
CLOSE_POLICY = 1008  # RFC 6455 "policy violation": bad key, unknown model
CLOSE_TRY_LATER = 1013


def model_abilities(ctx: ServingContext) -> ModelAbilities:
    can_speak = "audio" in ctx.shape.final_types
    return ModelAbilities(tuple(ctx.served_names), can_speak, model_voices(ctx.model_path, can_speak))


class RealtimeEndpoint:
    def __init__(self, ctx: ServingContext, model: ModelAbilities, limits: RealtimeLimits,
                 api_key: str | None) -> None:
        self.ctx, self.model, self.limits = ctx, model, limits
        self.api_key = api_key.encode() if api_key else None
        self.open_sessions = 0

    async def __call__(self, ws: WebSocket) -> None:
        if not authorized(ws, self.api_key):
            await ws.close(CLOSE_POLICY)  # before accept: the handshake fails with 403
            return
        offered = ws.scope.get("subprotocols", [])
        await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        link = _Link(ws)
        model = ws.query_params.get("model")
        if model is not None and model not in self.ctx.served_names:
            await link.fail(ProtocolError(f"the model {model!r} does not exist; this server serves "
                                          f"{self.ctx.served_names}", code="model_not_found", param="model"),
                            CLOSE_POLICY)
            return
        if self.open_sessions >= self.limits.max_sessions:
            await link.fail(ProtocolError(f"the server has {self.open_sessions} realtime sessions open, its limit; "
                                          "retry later", code="too_many_sessions", kind="server_error"),
                            CLOSE_TRY_LATER)
            return
        self.open_sessions += 1
        session = RealtimeSession(self.ctx, self.model, self.limits, link.send)
        try:
            await session.start()
            await self._serve(link, session)
        finally:
            self.open_sessions -= 1
            await session.close()
            await link.close()

    async def _serve(self, link: _Link, session: RealtimeSession) -> None:
        limits = self.limits
        ends_at = time.monotonic() + limits.max_session_s
        last_activity = time.monotonic()
        receive: asyncio.Task[Any] | None = None
        try:
            while True:
                receive = receive or asyncio.ensure_future(link.ws.receive())
                now = time.monotonic()
                if session.busy:
                    last_activity = now
                deadline = min(ends_at, last_activity + limits.idle_timeout_s)
                done, _ = await asyncio.wait({receive}, timeout=max(0.0, deadline - now))
                if not done:
                    if time.monotonic() >= ends_at:
                        await link.fail(ProtocolError(f"the session reached its maximum duration of "
                                                      f"{limits.max_session_s:g} s", code="session_expired"))
                        return
                    if not session.busy:
                        await link.fail(ProtocolError(f"no client event for {limits.idle_timeout_s:g} s; closing "
                                                      "the idle session", code="session_idle_timeout"))
                        return
                    continue
                message, receive = receive.result(), None
                if message["type"] == "websocket.disconnect":
                    link.gone = True
                    return
                last_activity = time.monotonic()
                await self._handle(link, session, message.get("text") or message.get("bytes") or b"")
        finally:
            if receive is not None:
                receive.cancel()

    @staticmethod
    async def _handle(link: _Link, session: RealtimeSession, payload: str | bytes) -> None:
        try:
            await session.handle(parse_client_event(payload))
        except ProtocolError as e:
            await link.send(events.error(e))
        except Exception as e:  # noqa: BLE001 - a bug fails the event, not the whole conversation
            logger.exception("realtime session %s: an event failed", session.id)
            await link.send(events.error(ProtocolError(f"internal error: {type(e).__name__}: {e}", code="server_error",
                                                       kind="server_error")))


def authorized(ws: WebSocket, api_key: bytes | None) -> bool:
    """The socket's handshake carries the key (a Bearer header, or the browser's subprotocol)."""
    if api_key is None:
        return True
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    offered = [p[len(KEY_PROTOCOL):] for p in ws.scope.get("subprotocols", []) if p.startswith(KEY_PROTOCOL)]
    candidates = ([token.strip()] if scheme.lower() == "bearer" else []) + offered
    return any(hmac.compare_digest(c.encode(), api_key) for c in candidates)


class _Link:
    """The socket's sending side: one writer at a time; sends after the client left are dropped."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()
        self.gone = False

    async def send(self, event: dict[str, Any]) -> None:
        if self.gone:
            return
        async with self.lock:
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # noqa: BLE001 - each server names "the client is gone" its own way
                self.gone = True  # the receive loop sees the disconnect and ends the session

    async def fail(self, err: ProtocolError, code: int = 1000) -> None:
        await self.send(events.error(err))
        await self.close(code)

    async def close(self, code: int = 1000) -> None:
        if not self.gone and self.ws.application_state == WebSocketState.CONNECTED:
            self.gone = True
            try:
                await self.ws.close(code)
            except Exception:  # noqa: BLE001 - the client closed at the same moment
                logger.debug("the realtime client left before the close frame")
