"""Every way a request can name media goes through one gate, on the shared reliability server
(default media policy: no internal addresses, no local files): smuggled source keys on every
part type and a realtime image aimed at a loopback decoy and a local file, answers that do not
tell a port or a file apart, per-request caps, and decompression bombs refused while a
neighbour request, timed alongside, is served as fast as before."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import websockets

from tests.multimodal.media_files import audio_bytes, flac_bomb, image_bytes, mp4_bytes, png_bomb
from tests.reliability.conftest import NAME
from tests.server.conftest import free_port

CHAT = "/v1/chat/completions"


class _Decoy(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Decoy.hits.append(self.path)
        body = image_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def decoy():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _Decoy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Decoy.hits.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "secret.png"
    path.write_bytes(image_bytes())
    return path


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*content, **body) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": list(content)}], "max_tokens": 2,
            "modalities": ["text"], **body}


def smuggled(decoy: str, secret: Path) -> list[dict]:
    png, wav = data_url(image_bytes(), "image/png"), data_url(audio_bytes("WAV", 0.5, 16000, 1), "audio/wav")
    mp4 = data_url(mp4_bytes(n_frames=8, fps=4), "video/mp4")
    input_audio = {"data": base64.b64encode(audio_bytes("WAV", 0.5, 16000, 1)).decode(), "format": "wav"}
    parts = []
    for target in (f"{decoy}/smuggled.png", str(secret), f"file://{secret}"):
        parts += [
            {"type": "image_url", "image_url": {"url": png}, "image": target},
            {"type": "image_url", "image_url": {"url": png}, "url": target},
            {"type": "image_url", "image_url": {"url": png}, "path": target},
            {"type": "audio_url", "audio_url": {"url": wav}, "audio": target},
            {"type": "input_audio", "input_audio": input_audio, "audio": target},
            {"type": "video_url", "video_url": {"url": mp4}, "video": [target, target]},
            {"type": "image", "image": target},
            {"type": "image_url", "image_url": {"url": target}},
        ]
    return parts


def test_smuggled_sources_never_reach_the_network_or_the_disk(server, decoy, secret):
    for part in smuggled(decoy, secret):
        r = server.post(CHAT, chat(part, {"type": "text", "text": "hi"}))
        assert r.status_code == 400, (part, r.text)
    r = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "multi_modal_data": {"image": decoy}})
    assert r.status_code == 400 and "multi_modal_data" in r.text
    assert _Decoy.hits == []


def test_refusals_do_not_tell_ports_or_files_apart(server, decoy, secret):
    """A refused target gets one answer whether it exists, listens, or fails (no port scanner, no
    file-existence oracle)."""
    def message(url: str) -> str:
        r = server.post(CHAT, chat({"type": "image_url", "image_url": {"url": url}}))
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"].replace(url, "URL")

    ports = {message(f"{decoy}/cat.png"), message(f"http://127.0.0.1:{free_port()}/cat.png"),
             message("http://no-such-host.invalid/cat.png"), message("http://169.254.169.254/latest/")}
    files = {message(str(secret)), message(str(secret.with_name("missing.png"))), message(f"file://{secret}"),
             message("/etc/passwd")}
    assert len(ports) == 1 and len(files) == 1, (ports, files)
    assert _Decoy.hits == []


def test_a_realtime_image_goes_through_the_gate(server, decoy, secret):
    async def refused(url: str) -> dict:
        async with websockets.connect(f"ws://127.0.0.1:{server.proc.port}/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url}]}}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if event["type"] in ("error", "conversation.item.done"):
                    return event

    for url in (f"{decoy}/realtime.png", str(secret), f"file://{secret}"):
        event = asyncio.run(refused(url))
        assert event["type"] == "error" and event["error"]["code"] == "invalid_image", event
    assert _Decoy.hits == []


def test_a_data_url_of_another_kind_is_400(server):
    r = server.post(CHAT, chat({"type": "image_url", "image_url": {"url": data_url(image_bytes(), "audio/wav")}}))
    assert r.status_code == 400 and "'audio/wav' cannot be image media" in r.json()["error"]["message"]


def test_media_items_per_request_are_capped(server):
    tiny = {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(8, 8)), "image/png")}}
    r = server.post(CHAT, chat(*[tiny] * 33))  # the default --max-media-items is 32
    assert r.status_code == 400 and "--max-media-items" in r.json()["error"]["message"]


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024


def timed(send) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = send()
    return response, time.monotonic() - started


@pytest.mark.parametrize("kind", ["input_audio", "transcription", "image"])
def test_a_decompression_bomb_is_refused_while_decoding_and_a_neighbour_is_not_held(server, kind):
    """An hour of audio in 90 kB of FLAC, a 6000x6000 PNG in 100 kB: refused at the limit, while a
    plain chat sent alongside takes about as long as it does alone."""
    bomb = flac_bomb(hours=1.0) if kind != "image" else png_bomb(6000, 6000)
    if kind == "transcription":
        send_bomb = lambda: httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": NAME},  # noqa: E731
                                       files={"file": ("long.flac", bomb, "audio/flac")}, timeout=120)
    else:
        part = ({"type": "input_audio", "input_audio": {"data": base64.b64encode(bomb).decode(), "format": "flac"}}
                if kind == "input_audio" else {"type": "image_url", "image_url": {"url": data_url(bomb, "image/png")}})
        send_bomb = lambda: server.post(CHAT, chat(part), timeout=120)  # noqa: E731
    neighbour = lambda: server.post(CHAT, chat({"type": "text", "text": "hi"}))  # noqa: E731
    _, alone = timed(neighbour)
    peak_before = peak_rss_mb(server.proc.proc.pid)
    with ThreadPoolExecutor(2) as pool:
        bombed = pool.submit(timed, send_bomb)
        time.sleep(0.05)
        beside = pool.submit(timed, neighbour)
        (refused, _), (served, beside_s) = bombed.result(), beside.result()
    limit = "--max-image-pixels" if kind == "image" else "--max-audio-duration"
    assert refused.status_code == 400 and limit in refused.json()["error"]["message"], refused.text
    assert served.status_code == 200, served.text
    assert beside_s < max(5 * alone, alone + 3.0), (beside_s, alone)
    assert peak_rss_mb(server.proc.proc.pid) - peak_before < 300  # never decoded whole (an hour: 115 MB+)
