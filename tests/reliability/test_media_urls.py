"""Media URLs cannot reach the server's own network: loopback, private, link-local and other
internal addresses are refused after DNS resolution and on every redirect, unless the
operator allows them (--allowed-media-domains, --allow-private-media-urls); errors do not echo
what was fetched. Against a real local HTTP server (which is itself on loopback)."""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.server.conftest import free_port
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.media_fetch import MediaPolicy, resolve_media

PAYLOAD = b"\x89PNG not really an image"
SECRET = b"internal secret page"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        port = self.server.server_address[1]
        routes = {"/cat.png": (200, {}, PAYLOAD),
                  "/to-localhost": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
                  "/to-loopback": (302, {"Location": f"http://127.0.0.1:{port}/cat.png"}, b""),
                  "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
                  "/loop": (302, {"Location": "/loop"}, b""),
                  "/secret": (403, {}, SECRET)}
        status, headers, body = routes.get(self.path, (404, {}, SECRET))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def port():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def fetch(url: str, **policy) -> bytes:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    out = asyncio.run(resolve_media(messages, MediaPolicy(timeout_s=5, **policy)))
    return out[0]["content"][0]["image_url"]["url"]


def refused(url: str, match: str, **policy) -> str:
    with pytest.raises(APIError) as e:
        fetch(url, **policy)
    assert e.value.status == 400 and match in e.value.message, e.value.message
    assert SECRET.decode() not in e.value.message
    return e.value.message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "2130706433", "0.0.0.0", "10.0.0.1",
                                  "169.254.169.254", "[::ffff:127.0.0.1]", "224.0.0.1", "100.64.0.1"])
def test_internal_addresses_are_refused_by_default(port, host):
    refused(f"http://{host}:{port}/cat.png", "not a public internet address")


def test_redirects_are_checked_hop_by_hop(port):
    assert fetch(f"http://localhost:{port}/to-localhost", allowed_domains=("localhost",)) == PAYLOAD
    refused(f"http://localhost:{port}/to-loopback", "not in --allowed-media-domains", allowed_domains=("localhost",))
    refused(f"http://localhost:{port}/to-metadata", "not in --allowed-media-domains", allowed_domains=("localhost",))
    refused(f"http://localhost:{port}/loop", "redirects", allow_private=True)


def test_operators_can_allow_internal_hosts(port):
    assert fetch(f"http://127.0.0.1:{port}/cat.png", allow_private=True) == PAYLOAD
    assert fetch(f"http://localhost:{port}/cat.png", allowed_domains=("localhost",)) == PAYLOAD
    refused(f"http://127.0.0.1:{port}/cat.png", "not in --allowed-media-domains", allowed_domains=("localhost",))


def test_errors_do_not_echo_what_was_fetched(port):
    message = refused(f"http://127.0.0.1:{port}/secret", "HTTP 403", allow_private=True)
    assert "127.0.0.1" in message and "secret page" not in message  # the URL the client gave, nothing more
    refused(f"http://127.0.0.1:{free_port()}/x.png", "failed (ConnectError)", allow_private=True)
    refused("http://no-such-host.invalid/x.png", "does not resolve")  # as an internal host: no DNS oracle
    refused("http://no-such-host.invalid/x.png", "cannot resolve", allow_private=True)
