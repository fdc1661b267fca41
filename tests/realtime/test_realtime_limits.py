"""The realtime socket's bounds that need no model: Origin, event size, what a conversation
holds, images through the media gate (Starlette's test client), and a client that never reads
(a real uvicorn on a real socket, where writes can block)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time

import pytest
import uvicorn
import websockets
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tests.multimodal.media_files import image_bytes
from tests.realtime.test_realtime_units import app, events_until_close
from tests.server.conftest import free_port
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits


def user_item(*content: dict, **item) -> str:
    return json.dumps({"type": "conversation.item.create",
                       "item": {"type": "message", "role": "user", "content": list(content), **item}})


def text(n: int) -> dict:
    return {"type": "input_text", "text": "x" * n}


def until(ws, *kinds: str) -> dict:
    while True:
        event = json.loads(ws.receive_text())
        if event["type"] in kinds:
            return event


@pytest.mark.parametrize("origin, allowed, accepted", [
    (None, (), True),  # not a browser
    ("http://testserver", (), True),  # the server's own page
    ("http://evil.example", (), False),
    ("null", (), False),  # a sandboxed page or a file
    ("http://testserver:8080", (), False),  # another port is another origin
    ("https://app.example.com", ("https://app.example.com",), True),
    ("https://app.example.com/", ("https://APP.example.com",), True),
    ("http://evil.example", ("https://app.example.com",), False),
    ("http://evil.example", ("*",), True),
])
def test_the_origin_is_checked(origin, allowed, accepted):
    headers = {"origin": origin} if origin else {}
    with TestClient(app(RealtimeLimits(allowed_origins=allowed))) as client:
        if accepted:
            with client.websocket_connect("/v1/realtime", headers=headers) as ws:
                assert json.loads(ws.receive_text())["type"] == "session.created"
            return
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/realtime", headers=headers):
                pass
        assert refused.value.code == 1008


def test_an_event_over_the_size_limit_closes_the_socket():
    with TestClient(app(RealtimeLimits(max_event_bytes=1000))) as client, \
            client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
        ws.send_text(user_item(text(2000)))
        got = events_until_close(ws)
    assert got[0]["error"]["code"] == "event_too_large" and got[-1] == {"closed": 1009}


def test_the_conversation_keeps_bounded_items_and_text():
    limits = RealtimeLimits(max_items=3, max_text_chars=100)
    with TestClient(app(limits)) as client, client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
        ws.send_text(user_item(text(101)))
        error = until(ws, "error")["error"]
        assert "over the session's limit of 100" in error["message"]
        ids = []
        for _ in range(4):  # the fourth item pushes the first out
            ws.send_text(user_item(text(10)))
            ids.append(until(ws, "conversation.item.done")["item"]["id"])
        ws.send_text(json.dumps({"type": "conversation.item.retrieve", "item_id": ids[0]}))
        assert until(ws, "error", "conversation.item.retrieved")["error"]["code"] == "item_not_found"
        ws.send_text(user_item(text(80)))  # 20 + 80 + 10 > 100: the oldest text goes
        ws.send_text(json.dumps({"type": "conversation.item.retrieve", "item_id": ids[1]}))
        assert until(ws, "error", "conversation.item.retrieved")["error"]["code"] == "item_not_found"
        ws.send_text(json.dumps({"type": "session.update", "session": {"instructions": "x" * 101}}))
        assert until(ws, "error", "session.updated")["error"]["param"] == "session.instructions"


def test_images_go_through_the_media_gate():
    """The test app's policy is a server's default: no internal addresses, no local files."""
    png = base64.b64encode(image_bytes()).decode()
    with TestClient(app(RealtimeLimits())) as client, client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
        for url, match in [("http://127.0.0.1:9/cat.png", "not a public internet address"),
                           ("file:///etc/passwd", "local media files are not allowed"),
                           ("/etc/passwd", "local media files are not allowed"),
                           (f"data:audio/wav;base64,{png}", "cannot be image media"),
                           ("data:image/png;base64," + base64.b64encode(b"junk").decode(), "cannot decode image")]:
            ws.send_text(user_item({"type": "input_image", "image_url": url}))
            error = until(ws, "error", "conversation.item.done")["error"]
            assert error["code"] == "invalid_image" and match in error["message"], error
        ws.send_text(user_item({"type": "input_image", "image_url": f"data:image/png;base64,{png}"}))
        assert until(ws, "error", "conversation.item.done")["item"]["content"][0]["type"] == "input_image"


@contextlib.contextmanager
def real_server(limits: RealtimeLimits):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app(limits), host="127.0.0.1", port=port, log_level="warning",
                                           ws_max_size=limits.max_event_bytes))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"ws://127.0.0.1:{port}/v1/realtime"
    finally:
        server.should_exit = True
        thread.join(10)


def stalled_client(port: int) -> socket.socket:
    """A WebSocket client that does the handshake and then never reads again (a tiny receive
    buffer, so the server's writes block soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(1)
    assert response.startswith(b"HTTP/1.1 101"), response
    return sock


def client_frame(text: str) -> bytes:
    """A masked text frame (mask key 0: the payload goes as it is)."""
    data, n = text.encode(), len(text.encode())
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 \
        else bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return b"\x81" + size + b"\0\0\0\0" + data


def test_a_client_that_never_reads_loses_its_session_at_the_idle_limit():
    """Its writes block: the session still ends on the server's clock and frees its slot."""
    limits = RealtimeLimits(max_sessions=1, idle_timeout_s=1.0, max_text_chars=100_000)

    def flood(sock: socket.socket) -> None:
        try:
            sock.sendall(client_frame(user_item(text(90_000), id="big")))
            for _ in range(400):  # 400 echoes of a 90 kB item: far more than the socket buffers hold
                sock.sendall(client_frame(json.dumps({"type": "conversation.item.retrieve", "item_id": "big"})))
        except OSError:
            pass  # the server closed the socket: what the test waits for

    async def next_session(url: str) -> tuple[str, float]:
        started = time.monotonic()
        while time.monotonic() - started < 20:
            async with websockets.connect(url) as other:
                first = json.loads(await other.recv())
            if first["type"] == "session.created":
                return "freed", time.monotonic() - started
            await asyncio.sleep(0.5)
        return "held", time.monotonic() - started

    with real_server(limits) as url:
        sock = stalled_client(int(url.split(":")[2].split("/")[0]))
        sender = threading.Thread(target=flood, args=(sock,), daemon=True)
        sender.start()
        try:
            outcome, after = asyncio.run(next_session(url))
        finally:
            sock.close()
            sender.join(10)
    assert outcome == "freed" and after < 15, (outcome, after)


def test_allowed_origins_take_vllms_json_list_form_too():
    import argparse

    from vllm_omni.entrypoints.openai.realtime import limits

    parser = argparse.ArgumentParser()
    limits.add_arguments(parser)
    assert limits.from_args(parser.parse_args([])).allowed_origins == ()
    given = ["--allowed-origins", "https://a.example", '["https://b.example", "*"]']
    assert limits.from_args(parser.parse_args(given)).allowed_origins == ("https://a.example", "https://b.example", "*")
