"""`GET /v1/realtime`: the WebSocket, its authentication, and the bounds of a session.

    endpoint = RealtimeEndpoint(ctx, limits, api_key)
    app.add_api_websocket_route("/v1/realtime", endpoint)

With an API key the client authenticates as with OpenAI: `Authorization: Bearer <key>`, or,
from a browser (which cannot set headers on a WebSocket), the subprotocol
`openai-insecure-api-key.<key>`. A bad key closes the handshake (HTTP 403). So does a browser
page of another origin (its `Origin` header) unless `--allowed-origins` lists it: without an
API key, any web page could otherwise open a session from its visitor's browser. Clients that
send no Origin (not browsers) and pages of the server's own origin are accepted.
Client events are handled one at a time, in order; a response runs beside them, so the client
can cancel it or talk over it. A socket that drops cancels the session's response, which aborts
its request in every stage. Large events are parsed in a worker thread. Every write has a
deadline (the idle limit, and the session's end): a client that does not read loses its
session then, as an idle one does, and its slot is free again.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError, parse_client_event
from vllm_omni.entrypoints.openai.realtime.session import RealtimeSession
from vllm_omni.entrypoints.openai.realtime.session_config import ModelAbilities
from vllm_omni.entrypoints.openai.request_body import release_free_memory
from vllm_omni.entrypoints.openai.serving_base import ServingContext
from vllm_omni.entrypoints.openai.voices import model_voices

logger = logging.getLogger(__name__)

KEY_PROTOCOL = "openai-insecure-api-key."
CLOSE_POLICY = 1008  # RFC 6455 "policy violation": bad key, unknown model
CLOSE_TOO_BIG = 1009
CLOSE_TRY_LATER = 1013
OFF_LOOP_EVENT_BYTES = 64 * 1024  # larger events are parsed in a worker thread
TRIM_AFTER_BYTES = 1024 * 1024  # after an event this large the heap's free pages go back to the OS
CLOSE_WAIT_S = 2.0  # a session's last event and close frame are not waited for longer


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
        if not admitted(ws, self.api_key, self.limits.allowed_origins):
            await ws.close(CLOSE_POLICY)  # before accept: the handshake fails with 403
            return
        offered = ws.scope.get("subprotocols", [])
        await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        link = _Link(ws, self.limits)
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
        ends_at = link.ends_at
        last_activity = time.monotonic()
        receive: asyncio.Task[Any] | None = None
        lost = asyncio.ensure_future(link.lost.wait())
        try:
            while True:
                receive = receive or asyncio.ensure_future(link.ws.receive())
                now = time.monotonic()
                if session.busy:
                    last_activity = now
                deadline = min(ends_at, last_activity + limits.idle_timeout_s)
                done, _ = await asyncio.wait({receive, lost}, timeout=max(0.0, deadline - now),
                                             return_when=asyncio.FIRST_COMPLETED)
                if lost in done:  # a write timed out: the client does not read
                    return
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
                payload = message.get("text") or message.get("bytes") or b""
                if len(payload) > limits.max_event_bytes:  # the server caps frames too; other servers may not
                    await link.fail(ProtocolError(f"the event has {len(payload)} bytes, over the limit of "
                                                  f"{limits.max_event_bytes} (--realtime-max-event-bytes)",
                                                  code="event_too_large"), CLOSE_TOO_BIG)
                    return
                await self._handle(link, session, payload)
        finally:
            lost.cancel()
            if receive is not None:
                receive.cancel()

    @staticmethod
    async def _handle(link: _Link, session: RealtimeSession, payload: str | bytes) -> None:
        try:
            if len(payload) > OFF_LOOP_EVENT_BYTES:
                event = await asyncio.to_thread(parse_client_event, payload)
            else:
                event = parse_client_event(payload)
            await session.handle(event)
        except ProtocolError as e:
            await link.send(events.error(e))
        except Exception as e:  # noqa: BLE001 - a bug fails the event, not the whole conversation
            logger.exception("realtime session %s: an event failed", session.id)
            await link.send(events.error(ProtocolError(f"internal error: {type(e).__name__}: {e}", code="server_error",
                                                       kind="server_error")))
        if len(payload) >= TRIM_AFTER_BYTES:  # its copies are freed now; glibc would keep the pages
            await asyncio.to_thread(release_free_memory)


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a browser's Origin is the server's own (the Host the client connected to)."""
    page = urllib.parse.urlsplit(origin)
    if page.scheme not in ("http", "https") or not page.hostname or not host:
        return False
    default = 80 if page.scheme == "http" else 443
    server = urllib.parse.urlsplit(f"//{host}")
    try:
        return (page.hostname, page.port or default) == (server.hostname, server.port or default)
    except ValueError:  # a port that is not a number
        return False


def admitted(ws: WebSocket, api_key: bytes | None, allowed_origins: Sequence[str]) -> bool:
    """Whether a socket's handshake may go on: it carries the key, and a browser's page is the
    server's own or listed in --allowed-origins (a client that sends no Origin is no web page)."""
    return authorized(ws, api_key) and origin_allowed(ws, allowed_origins)


def origin_allowed(ws: WebSocket, allowed: Sequence[str]) -> bool:
    origin = ws.headers.get("origin")
    if origin is None:  # not a browser: nothing a web page could abuse
        return True
    return "*" in allowed or origin.rstrip("/").lower() in {o.rstrip("/").lower() for o in allowed} \
        or same_origin(origin, ws.headers.get("host"))


def authorized(ws: WebSocket, api_key: bytes | None) -> bool:
    """The socket's handshake carries the key (a Bearer header, or the browser's subprotocol)."""
    if api_key is None:
        return True
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    offered = [p[len(KEY_PROTOCOL):] for p in ws.scope.get("subprotocols", []) if p.startswith(KEY_PROTOCOL)]
    candidates = ([token.strip()] if scheme.lower() == "bearer" else []) + offered
    return any(hmac.compare_digest(c.encode(), api_key) for c in candidates)


class _Link:
    """The socket's sending side: one writer at a time; sends after the client left are dropped.
    A send that does not complete within the idle limit, or by the session's end, means the
    client does not read: the link is lost and the session ends on the server's clock."""

    def __init__(self, ws: WebSocket, limits: RealtimeLimits) -> None:
        self.ws, self.limits = ws, limits
        self.lock = asyncio.Lock()
        self.gone = False
        self.lost = asyncio.Event()
        self.ends_at = time.monotonic() + limits.max_session_s

    def _write_deadline(self) -> float:
        # At the session's end its last event (the `error` saying why) still gets a moment.
        return max(CLOSE_WAIT_S, min(self.limits.idle_timeout_s, self.ends_at - time.monotonic()))

    async def send(self, event: dict[str, Any]) -> None:
        if self.gone:
            return
        text = json.dumps(event)
        try:
            await asyncio.wait_for(self._write(text), self._write_deadline())
        except asyncio.TimeoutError:
            logger.warning("realtime: a client did not read for %.0f s; ending its session", self.limits.idle_timeout_s)
            self._lose()
        except Exception:  # noqa: BLE001 - each server names "the client is gone" its own way
            self._lose()  # the receive loop sees the disconnect and ends the session

    async def _write(self, text: str) -> None:
        async with self.lock:
            await self.ws.send_text(text)

    def _lose(self) -> None:
        self.gone = True
        self.lost.set()

    async def fail(self, err: ProtocolError, code: int = 1000) -> None:
        await self.send(events.error(err))
        await self.close(code)

    async def close(self, code: int = 1000) -> None:
        if self.ws.application_state != WebSocketState.CONNECTED:
            return
        was_gone, self.gone = self.gone, True
        try:
            # A client that does not read cannot take the close frame either: not waited for long.
            await asyncio.wait_for(self.ws.close(code), CLOSE_WAIT_S if not was_gone else 0.1)
        except Exception:  # noqa: BLE001 - the client closed at the same moment, or does not read
            logger.debug("the realtime client left before the close frame")
