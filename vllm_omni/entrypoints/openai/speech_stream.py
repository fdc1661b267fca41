"""`GET /v1/audio/speech/stream`: the speech socket (text in as it is written, speech out).

    endpoint = SpeechStreamEndpoint(ctx, speech, realtime_limits, stream_limits, api_key)
    app.add_api_websocket_route("/v1/audio/speech/stream", endpoint)

Events and sessions: speech_stream_protocol.py and speech_stream_session.py; docs/tts.md.
Authentication as for /v1/realtime (a Bearer header, or the browser's
`openai-insecure-api-key.<key>` subprotocol next to `realtime`). The realtime limits apply (open sessions, a
session's duration, idle time: --realtime-*), and the socket's own (tts_limits.py).

Two dialects on the one route: ours (speech_stream_protocol.py), and upstream vLLM-Omni's, which
a first message `session.config` picks (speech_stream_upstream.py translates it at the edge:
the same session, caps and limits).

Backpressure both ways:
- in: the socket is not read while the text received and not yet read by the talker is over
  --speech-stream-max-pending-chars: uvicorn then stops reading the connection, and TCP slows
  the client down;
- out: events go through a bounded queue to one sender; a send the client does not take within
  --speech-stream-send-timeout-s ends the session (its utterance is aborted in every stage).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from vllm_omni.entrypoints.openai.realtime import events
from vllm_omni.entrypoints.openai.realtime.endpoint import CLOSE_POLICY, CLOSE_TRY_LATER, admitted
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError
from vllm_omni.entrypoints.openai.speech_stream_protocol import parse_event
from vllm_omni.entrypoints.openai.speech_stream_session import SpeechStreamSession
from vllm_omni.entrypoints.openai.speech_stream_upstream import UpstreamDialect, picks_upstream
from vllm_omni.entrypoints.openai.tts_limits import SpeechStreamLimits

logger = logging.getLogger(__name__)

CLOSE_TOO_BIG = 1009  # RFC 6455 "message too big"
OUT_QUEUE_EVENTS = 32  # events waiting for the sender (an audio delta is ~0.1-2 s of speech)


class SpeechStreamEndpoint:
    def __init__(self, ctx: Any, speech: Any, realtime: RealtimeLimits, limits: SpeechStreamLimits,
                 api_key: str | None) -> None:
        self.ctx, self.speech, self.realtime, self.limits = ctx, speech, realtime, limits
        self.api_key = api_key.encode() if api_key else None
        self.open_sessions = 0

    async def __call__(self, ws: WebSocket) -> None:
        if not admitted(ws, self.api_key, self.realtime.allowed_origins):
            await ws.close(CLOSE_POLICY)  # before accept: the handshake fails with 403
            return
        # A browser offers "realtime" beside its key and needs one offered protocol chosen.
        await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", []) else None)
        sender = _Sender(ws, self.limits.send_timeout_s)
        problem = self._refusal(ws)
        if problem is not None:
            await sender.fail(*problem)
            return
        self.open_sessions += 1
        session = SpeechStreamSession(self.ctx, self.speech, self.limits, sender.send)
        try:
            await session.start()
            await self._serve(ws, session, sender)
        finally:
            self.open_sessions -= 1
            await session.close()
            await sender.close()

    def _refusal(self, ws: WebSocket) -> tuple[ProtocolError, int] | None:
        if self.speech.info is None:
            return ProtocolError(f"{self.ctx.served_names[0]} is not a text-to-speech model",
                                 code="model_not_supported"), CLOSE_POLICY
        model = ws.query_params.get("model")
        if model is not None and model not in self.ctx.served_names:
            return ProtocolError(f"the model {model!r} does not exist; this server serves {self.ctx.served_names}",
                                 code="model_not_found", param="model"), CLOSE_POLICY
        if self.open_sessions >= self.realtime.max_sessions:
            return ProtocolError(f"the server has {self.open_sessions} speech sessions open, its limit; retry later",
                                 code="too_many_sessions", kind="server_error"), CLOSE_TRY_LATER
        return None

    async def _serve(self, ws: WebSocket, session: SpeechStreamSession, sender: _Sender) -> None:
        ends_at = time.monotonic() + self.realtime.max_session_s
        last_activity = time.monotonic()
        receive: asyncio.Future[Any] | None = None
        dialect: UpstreamDialect | None = None  # None: ours, or not chosen yet
        first = True
        try:
            while True:
                now = time.monotonic()
                if session.busy:
                    last_activity = now
                session.progress.clear()
                waiters = [asyncio.ensure_future(session.finished.wait())]
                reading = session.pending_chars <= self.limits.max_pending_chars
                if reading:
                    receive = receive or asyncio.ensure_future(ws.receive())
                else:  # leave the socket unread (uvicorn stops reading it) until the talker reads on
                    waiters.append(asyncio.ensure_future(session.progress.wait()))
                deadline = min(ends_at, last_activity + self.realtime.idle_timeout_s)
                wanted = {sender.dead, *waiters, *([receive] if reading else [])}
                done, _ = await asyncio.wait(wanted, timeout=max(0.0, deadline - now),
                                             return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
                if sender.dead.done() or session.finished.is_set():
                    return
                if receive is None or receive not in done:
                    if not done and await self._expired(session, sender, ends_at):
                        return
                    continue
                message, receive = receive.result(), None
                if message["type"] == "websocket.disconnect":
                    sender.gone = True
                    return
                last_activity = time.monotonic()
                payload = message.get("text") or message.get("bytes") or b""
                if first and picks_upstream(payload):
                    dialect = UpstreamDialect(session, sender.send)
                    sender.translate = dialect.frames
                first = False
                if not await self._handle(session, dialect, sender, payload):
                    return
        finally:
            if receive is not None:
                receive.cancel()

    async def _expired(self, session: SpeechStreamSession, sender: _Sender, ends_at: float) -> bool:
        if time.monotonic() >= ends_at:
            await sender.fail(ProtocolError(f"the session reached its maximum duration of "
                                            f"{self.realtime.max_session_s:g} s", code="session_expired"))
            return True
        if not session.busy:
            await sender.fail(ProtocolError(f"no client event for {self.realtime.idle_timeout_s:g} s; closing the idle "
                                            "session", code="session_idle_timeout"))
            return True
        return False

    async def _handle(self, session: SpeechStreamSession, dialect: UpstreamDialect | None, sender: _Sender,
                      payload: str | bytes) -> bool:
        """False: the session must end."""
        if len(payload) > self.limits.max_frame_bytes:
            await sender.fail(ProtocolError(f"a message of {len(payload)} bytes is over the "
                                            f"{self.limits.max_frame_bytes} byte limit "
                                            "(--speech-stream-max-frame-bytes)", code="message_too_big"),
                              CLOSE_TOO_BIG)
            return False
        try:
            if dialect is not None:
                await dialect.receive(payload)
            else:
                await session.handle(parse_event(payload))
        except ProtocolError as e:
            if e.code == "input_text_too_long":
                await sender.fail(e, CLOSE_POLICY)
                return False
            await sender.send(events.error(e))
        except Exception as e:  # noqa: BLE001 - a bug fails the event, not the session
            logger.exception("speech session %s: an event failed", session.id)
            await sender.send(events.error(ProtocolError(f"internal error: {type(e).__name__}: {e}",
                                                         code="server_error", kind="server_error")))
        return True


async def _as_json(event: dict[str, Any]) -> list[str | bytes]:
    return [json.dumps(event)]


class _Sender:
    """One writer for the socket: events wait in a bounded queue (a full one blocks the
    producer); a send the client does not take within `timeout_s` ends the session. `translate`
    turns an event into the frames the session's dialect sends (text or binary)."""

    def __init__(self, ws: WebSocket, timeout_s: float) -> None:
        self.ws, self.timeout_s = ws, timeout_s
        self.translate: Callable[[dict[str, Any]], Awaitable[list[str | bytes]]] = _as_json
        self.queue: asyncio.Queue[tuple[dict[str, Any] | None, int]] = asyncio.Queue(OUT_QUEUE_EVENTS)
        self.dead: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gone = False
        self.task = asyncio.create_task(self._run())

    async def send(self, event: dict[str, Any]) -> None:
        if not self.dead.done():
            await self.queue.put((event, 0))

    async def fail(self, err: ProtocolError, code: int = 1000) -> None:
        """An `error` event, then the close frame."""
        await self.send(events.error(err))
        await self.close(code)

    async def close(self, code: int = 1000) -> None:
        """Send what is queued (within the timeout), then close the socket."""
        if not self.dead.done():
            await self.queue.put((None, code))
            await asyncio.wait({self.task}, timeout=self.timeout_s + 1.0)
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if not self.gone and self.ws.application_state == WebSocketState.CONNECTED:
            self.gone = True
            try:
                await asyncio.wait_for(self.ws.close(code), self.timeout_s)
            except Exception:  # noqa: BLE001 - the client left, or does not read at all
                logger.debug("the speech client left before the close frame")

    async def _run(self) -> None:
        try:
            while True:
                event, code = await self.queue.get()
                if event is None:
                    await asyncio.wait_for(self.ws.close(code), self.timeout_s)
                    self.gone = True
                    break
                for frame in await self.translate(event):
                    send = self.ws.send_bytes(frame) if isinstance(frame, bytes) else self.ws.send_text(frame)
                    await asyncio.wait_for(send, self.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("speech client did not read for %.1f s; dropping its session", self.timeout_s)
        except Exception:  # noqa: BLE001 - each server names "the client is gone" its own way
            self.gone = True
        finally:
            if not self.dead.done():
                self.dead.set_result(None)
