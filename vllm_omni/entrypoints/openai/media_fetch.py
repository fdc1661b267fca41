"""The server's side of the media gate: every media source a request names is fetched here,
concurrently and asynchronously, before the request is admitted.

    messages = await resolve_media(messages, policy)        # chat: every media part, one budget
    data = await fetch_media(url, "image", policy)           # one item (a realtime image, ref_audio)
    count_upload(len(data), policy)                          # an upload (transcription, image edit)

The rules are multimodal/media_fetch.py's (addresses, redirects, local files, data-URL types,
bytes, deadlines); here they apply per request: at most `max_items` items and
`max_total_bytes` bytes (MediaBudget), inline `input_audio` included. A refusal is a 400
naming the URL the client sent. The engine's input processor then only sees bytes or vetted
paths, and decodes them (under the same policy's decode limits) in its worker thread, outside
any lock other requests wait on.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.multimodal.media_fetch import fetch
from vllm_omni.multimodal.media_policy import MediaBudget, MediaError, MediaPolicy

__all__ = ["MediaPolicy", "count_upload", "fetch_media", "resolve_media"]

_URL_KINDS = {"image_url": "image", "audio_url": "audio", "video_url": "video"}


async def resolve_media(messages: list[dict[str, Any]], policy: MediaPolicy) -> list[dict[str, Any]]:
    """Engine-ready messages with every media URL replaced by bytes or a Path. The first
    failure is a 400 (the other downloads are cancelled)."""
    budget = MediaBudget(policy)
    fetched: list[tuple[dict[str, Any], str]] = []  # (a copy of the part, its key)
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            key = part.get("type")
            if key in _URL_KINDS:
                part = dict(part)
                fetched.append((part, key))
            elif key == "input_audio":
                _gated(_count_inline, part[key]["data"], budget)
            parts.append(part)
        out.append({**message, "content": parts})
    sources = await _all(fetch(_url_of(part[key]), _URL_KINDS[key], policy, budget) for part, key in fetched)
    for (part, key), source in zip(fetched, sources, strict=True):
        part[key] = {**part[key], "url": source} if isinstance(part[key], dict) else {"url": source}
    return out


async def fetch_media(source: str, kind: str, policy: MediaPolicy, budget: MediaBudget | None = None) -> Any:
    """One item: bytes or a vetted Path. 400 when refused."""
    return (await _all([fetch(source, kind, policy, budget or MediaBudget(policy))]))[0]


def count_upload(size: int, policy: MediaPolicy) -> None:
    """An uploaded file is one media item of the request: 400 over the byte limits."""
    _gated(_count_bytes, size, MediaBudget(policy), "the file")


def _count_inline(data: str, budget: MediaBudget) -> None:
    _count_bytes(len(data) * 3 // 4, budget, "an input_audio")  # base64: decoded by the input processor


def _count_bytes(size: int, budget: MediaBudget, what: str) -> None:
    budget.take_item()
    if size > budget.policy.max_bytes:
        raise MediaError(f"{what} is {size} bytes, over the {budget.policy.max_bytes} byte media limit "
                         "(--max-media-bytes)")
    budget.take_bytes(size)


def _gated(check: Any, *args: Any) -> None:
    try:
        check(*args)
    except MediaError as e:
        raise APIError(400, str(e)) from None


async def _all(jobs: Iterable[Awaitable[Any]]) -> list[Any]:
    tasks = [asyncio.ensure_future(job) for job in jobs]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except MediaError as e:
        raise APIError(400, str(e)) from None
    finally:
        for task in tasks:
            task.cancel()


def _url_of(value: Any) -> str:
    return value["url"] if isinstance(value, dict) else value
