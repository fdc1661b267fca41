"""The media gate: a source string -> bytes (or a vetted local Path), under a MediaPolicy.

    data = await fetch("https://host/cat.png", "image", policy, budget)   # MediaError when refused
    data = fetch_blocking(source, "audio", policy)                          # the same, from sync code

Every way a client can name media ends here: chat parts, realtime items, TTS reference audio
(uploads and edit images are bytes already and only counted). One set of rules:
- `data:` URLs: the MIME type must be of the part's kind (an image part cannot carry
  `audio/wav`); no type at all is accepted; the size is checked before decoding the base64;
- http(s): only addresses url_guard.py allows, redirects checked hop by hop, the whole
  download within `timeout_s`, at most `max_bytes` (counted while it arrives, whatever
  Content-Length says), no more than the request's budget;
- `file://` URLs and plain paths: only under `allowed_local_root`; a refused path gets the same
  answer whether or not it exists (no file-existence oracle);
- anything else is refused.
Errors name the URL the client sent and what went wrong, never fetched content or addresses.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import urllib.parse
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx

from vllm_omni.multimodal.media_policy import MediaBudget, MediaError, MediaPolicy
from vllm_omni.multimodal.url_guard import guard_url

MAX_REDIRECTS = 5


def decode_base64(data: str, what: str = "media") -> bytes:
    try:
        # validate=True: reject non-alphabet characters instead of silently dropping them.
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 {what}: {e}") from None


def decode_data_url(url: str, kind: str, max_bytes: int) -> bytes:
    """The bytes of a `data:[<type>][;base64],<data>` URL holding `kind` media."""
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("invalid data URL: no ',' separating the header from the data")
    params = header.split(";")
    mime = params[0].strip().lower()
    if mime and mime.partition("/")[0] != kind:
        raise MediaError(f"a data URL of type {mime!r} cannot be {kind} media; send {kind}/* data in an {kind} part")
    encoded = len(params) > 1 and params[-1].strip().lower() == "base64"
    if (len(payload) * 3 // 4 if encoded else len(payload) // 3) > max_bytes:  # before decoding anything
        raise MediaError(f"a data URL is over the {max_bytes} byte media limit (--max-media-bytes)")
    data = decode_base64(payload, "data URL") if encoded else urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"a data URL is over the {max_bytes} byte media limit (--max-media-bytes)")
    return data


async def fetch(source: str, kind: str, policy: MediaPolicy, budget: MediaBudget) -> bytes | Path:
    """One media item named by a string. Counts against `budget` (one item, its bytes)."""
    budget.take_item()
    if is_http(source):
        return await download(source, policy, budget)
    return _inline_or_local(source, kind, policy, budget)


def fetch_blocking(source: str, kind: str, policy: MediaPolicy, budget: MediaBudget | None = None) -> bytes | Path:
    """`fetch` for synchronous callers (the input processors of the offline APIs)."""
    budget = budget or MediaBudget(policy)
    budget.take_item()
    if is_http(source):
        return _run(download(source, policy, budget))
    return _inline_or_local(source, kind, policy, budget)


def is_http(source: str) -> bool:
    return urllib.parse.urlsplit(source).scheme.lower() in ("http", "https")


def _inline_or_local(source: str, kind: str, policy: MediaPolicy, budget: MediaBudget) -> bytes | Path:
    if source.startswith("data:"):
        data = decode_data_url(source, kind, policy.max_bytes)
        budget.take_bytes(len(data))
        return data
    split = urllib.parse.urlsplit(source)
    scheme = split.scheme.lower()
    if scheme == "file":
        path = Path(urllib.parse.unquote(split.path))
    elif scheme and len(scheme) > 1:  # "c:" is a Windows drive, not a scheme
        raise MediaError(f"unsupported media URL scheme {scheme!r} in {shorten(source)}; use http(s), data or file")
    else:
        path = Path(source)
    path = local_file(path, source, policy)
    budget.take_bytes(path.stat().st_size)
    return path


def local_file(path: Path, shown: Any, policy: MediaPolicy) -> Path:
    """`path` resolved and checked against the local-file rules; `shown` names it in errors."""
    root = policy.allowed_local_root
    if root is None:
        raise MediaError(f"local media files are not allowed on this server ({shorten(shown)}); send a data URL "
                         "or an http(s) URL, or start the server with --allowed-local-media-path")
    try:
        resolved = path.expanduser().resolve()
        # Outside the root, nothing about the path is looked at: existing or not, the same answer.
        if not resolved.is_relative_to(root.resolve()):
            raise MediaError(f"media path {shorten(shown)} is outside --allowed-local-media-path {root}")
        if not resolved.is_file():
            raise MediaError(f"no such media file: {shorten(shown)}")
        size = resolved.stat().st_size
    except OSError as e:  # e.g. a base64 blob sent without its "data:" prefix: name too long
        raise MediaError(f"not a URL, data URL or readable file: {e.strerror}") from None
    if size > policy.max_bytes:
        raise MediaError(f"media file {shorten(shown)} is {size} bytes, over the {policy.max_bytes} byte media limit "
                         "(--max-media-bytes)")
    return resolved


async def download(url: str, policy: MediaPolicy, budget: MediaBudget) -> bytes:
    try:
        # The deadline bounds the whole download: a server dripping bytes cannot hold the request.
        return await asyncio.wait_for(_read_limited(url, policy, budget), policy.timeout_s)
    except asyncio.TimeoutError:
        raise MediaError(f"fetching {shorten(url)} timed out after {policy.timeout_s} s") from None
    except httpx.HTTPError as e:
        # The exception's text can name internal addresses; its kind is enough for the client.
        raise MediaError(f"fetching {shorten(url)} failed ({type(e).__name__})") from None


async def _read_limited(url: str, policy: MediaPolicy, budget: MediaBudget) -> bytes:
    try:
        current = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise MediaError(f"invalid media URL {shorten(url)}: {e}") from None
    async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = await guard_url(current, policy, shorten(url))
            async with client.stream("GET", target.connect_url, headers=target.headers,
                                     extensions=target.extensions) as resp:
                if resp.is_redirect:
                    current = current.join(resp.headers.get("location", ""))
                    continue
                if resp.status_code != 200:
                    raise MediaError(f"fetching {shorten(url)} failed: HTTP {resp.status_code}")
                return await _body(resp, url, policy.max_bytes, budget)
    raise MediaError(f"fetching {shorten(url)} failed: more than {MAX_REDIRECTS} redirects")


async def _body(resp: httpx.Response, url: str, max_bytes: int, budget: MediaBudget) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{shorten(url)} is {declared} bytes, over the {max_bytes} byte media limit (--max-media-bytes)")
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:  # the header can be absent or lie
            raise MediaError(f"{shorten(url)} is over the {max_bytes} byte media limit (--max-media-bytes)")
        budget.take_bytes(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


def _run(coro: Coroutine[Any, Any, bytes]) -> bytes:
    """Run a download from synchronous code, also from a thread whose event loop is running
    (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def shorten(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."
