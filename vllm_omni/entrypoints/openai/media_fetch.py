"""Fetch the media a chat request points at, under the server's policy, before generation.

The engine's multimodal processor can read URLs and files itself, but on a server that is a
security and liveness question: any client could make the server read any local file, or hold
a request (and the event loop) on a slow download. So every `image_url` / `audio_url` /
`video_url` is resolved here first:

- data URLs stay as they are (the processor decodes them; bad base64 -> 400);
- http(s) URLs are downloaded asynchronously with a size limit and a deadline -> bytes, only
  from public addresses unless the server allows more (url_guard.py), redirects checked hop
  by hop;
- file:// URLs and plain paths are allowed only under `--allowed-local-media-path` -> a Path;
- anything else is a 400.

The processor then only ever sees bytes, data URLs or vetted paths.
"""
from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.url_guard import guard_url

_URL_KEYS = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url"}
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_root: Path | None = None  # None: local files are refused
    timeout_s: float = 10.0  # whole download, per URL
    max_bytes: int = 64 * 1024 * 1024
    allowed_domains: tuple[str, ...] = ()  # non-empty: only these hosts (and their subdomains)
    allow_private: bool = False  # let URLs reach loopback / private / link-local addresses


async def resolve_media(messages: list[dict[str, Any]], policy: MediaPolicy) -> list[dict[str, Any]]:
    """Engine-ready messages with every media URL replaced by bytes / a Path (data URLs kept).

    Downloads run concurrently; the first failure is a 400 naming the URL."""
    jobs: list[tuple[dict[str, Any], str, Any]] = []  # (part, key, awaitable source)
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            key = _URL_KEYS.get(part.get("type"))
            if key is not None:
                part = dict(part)
                jobs.append((part, key, _resolve_url(_url_of(part[key]), policy)))
            parts.append(part)
        out.append({**message, "content": parts})
    if jobs:
        sources = await asyncio.gather(*(job for _, _, job in jobs))
        for (part, key, _), source in zip(jobs, sources, strict=True):
            part[key] = {**part[key], "url": source} if isinstance(part[key], dict) else {"url": source}
    return out


def _url_of(value: Any) -> str:
    return value["url"] if isinstance(value, dict) else value


async def _resolve_url(url: str, policy: MediaPolicy) -> Any:
    if url.startswith("data:"):
        return url
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return await _download(url, policy)
    if scheme == "file":
        return _local_file(Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)), url, policy)
    if scheme:
        raise APIError(400, f"unsupported media URL scheme {scheme!r} in {_short(url)}; use http(s), data or file")
    return _local_file(Path(url), url, policy)


def _local_file(path: Path, url: str, policy: MediaPolicy) -> Path:
    if policy.allowed_local_root is None:
        raise APIError(400, f"local media files are not allowed on this server ({_short(url)}); send a data URL "
                            "or an http(s) URL, or start the server with --allowed-local-media-path")
    root = policy.allowed_local_root.resolve()
    try:
        resolved = path.expanduser().resolve()
    except OSError as e:
        raise APIError(400, f"bad media path {_short(url)}: {e.strerror}") from None
    if not resolved.is_relative_to(root):
        raise APIError(400, f"media path {_short(url)} is outside --allowed-local-media-path {root}")
    if not resolved.is_file():
        raise APIError(400, f"no such media file: {_short(url)}")
    return resolved


async def _download(url: str, policy: MediaPolicy) -> bytes:
    try:
        # The deadline bounds the whole download: a server dripping bytes cannot hold the request.
        return await asyncio.wait_for(_read_limited(url, policy), policy.timeout_s)
    except asyncio.TimeoutError:
        raise APIError(400, f"fetching {_short(url)} took longer than {policy.timeout_s} s") from None
    except httpx.HTTPError as e:
        # The exception's text can name internal addresses; its kind is enough for the client.
        raise APIError(400, f"fetching {_short(url)} failed ({type(e).__name__})") from None


async def _read_limited(url: str, policy: MediaPolicy) -> bytes:
    try:
        current = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise APIError(400, f"invalid media URL {_short(url)}: {e}") from None
    async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = await guard_url(current, policy.allowed_domains, policy.allow_private, _short(url))
            async with client.stream("GET", target.connect_url, headers=target.headers,
                                     extensions=target.extensions) as resp:
                if resp.is_redirect:
                    current = current.join(resp.headers.get("location", ""))
                    continue
                if resp.status_code != 200:
                    raise APIError(400, f"fetching {_short(url)} failed: HTTP {resp.status_code}")
                return await _body(resp, url, policy.max_bytes)
    raise APIError(400, f"fetching {_short(url)} failed: more than {MAX_REDIRECTS} redirects")


async def _body(resp: httpx.Response, url: str, max_bytes: int) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(400, f"{_short(url)} is {declared} bytes, over the {max_bytes} byte media limit")
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:  # the header can be absent or lie
            raise APIError(400, f"{_short(url)} is over the {max_bytes} byte media limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
