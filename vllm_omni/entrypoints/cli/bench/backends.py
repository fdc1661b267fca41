"""One benchmark request per backend (`--backend`), over HTTP with httpx, timed on the client.

    openai-chat-omni   /v1/chat/completions, streamed: text deltas and audio chunks (upstream's
                       omni backend; audio in `delta.audio.data` or, upstream's shape,
                       `delta.content` of a chunk marked `"modality": "audio"`)
    openai-chat        /v1/chat/completions, streamed text (vLLM's)
    openai, vllm       /v1/completions, streamed text (vLLM's)
    openai-audio-speech  /v1/audio/speech with `stream: true`, `response_format: pcm` (16-bit mono,
                       --audio-sample-rate): audio as it is made
    openai-images      /v1/images/generations, one JSON answer

Every audio chunk's arrival time and length are kept (`RequestResult.audio_chunks`) for the
playback figures (metrics.py); text deltas for TTFT / ITL.
"""
from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_omni.entrypoints.cli.bench.datasets import SampleRequest

DEFAULT_ENDPOINTS = {"openai-chat-omni": "/v1/chat/completions", "openai-chat": "/v1/chat/completions",
                     "openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-audio-speech": "/v1/audio/speech", "openai-images": "/v1/images/generations"}
BACKENDS = tuple(DEFAULT_ENDPOINTS)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter seconds
    latency: float = 0.0  # end to end, s
    ttft: float | None = None  # first text, s after start
    itl: list[float] = field(default_factory=list)  # gaps between text deltas, s
    text_latency: float = 0.0  # the last text delta, s after start
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    audio_chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival s after start, seconds)
    images: int = 0

    @property
    def audio_seconds(self) -> float:
        return sum(d for _, d in self.audio_chunks)


@dataclass(frozen=True)
class Target:
    url: str  # the endpoint's full URL
    model: str
    headers: dict[str, str]
    extra_body: dict[str, Any]
    ignore_eos: bool
    sample_rate: int  # of raw PCM audio


RequestFn = Callable[[httpx.AsyncClient, Target, SampleRequest], Awaitable[RequestResult]]


async def _sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The stream's JSON events; ValueError at an error sent in-band (the request failed after
    its 200: a stage that broke mid-stream), or a choice that finished with one (a partial
    response: the output asked for did not all come)."""
    async for line in response.aiter_lines():
        if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
            event = json.loads(data)
            failed = [event] if "error" in event else [c for c in event.get("choices") or []
                                                        if c.get("finish_reason") == "error"]
            if failed:
                error = failed[0].get("error") or {}
                raise ValueError(f"in-band error: {error.get('message', error) if isinstance(error, dict) else error}")
            yield event


def _body(target: Target, sample: SampleRequest, **fields: Any) -> dict[str, Any]:
    body = {"model": target.model, **fields}
    if sample.output_len is not None:
        body["max_tokens"] = sample.output_len
    if target.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **target.extra_body}


async def _timed(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                 read: Callable[[httpx.Response, RequestResult], Awaitable[None]]) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return result
            await read(response, result)
        result.latency = time.perf_counter() - result.start
        if not result.output_tokens and result.ttft is not None:  # no usage reported: one token per delta
            result.output_tokens = len(result.itl) + 1
        result.success = True
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # a broken stream fails this request alone
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _on_text(result: RequestResult, text: str) -> None:
    now = time.perf_counter() - result.start
    if result.ttft is None:
        result.ttft = now
    else:
        result.itl.append(now - result.text_latency)
    result.text_latency = now
    result.text += text


def _usage(result: RequestResult, chunk: dict[str, Any]) -> None:
    if usage := chunk.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
        result.output_tokens = usage.get("completion_tokens") or result.output_tokens


def audio_file_seconds(data: bytes) -> float:
    """Length of one encoded audio chunk (a complete file: WAV, else whatever soundfile reads)."""
    if data[:4] == b"RIFF":
        with wave.open(io.BytesIO(data)) as w:
            return w.getnframes() / w.getframerate()
    import soundfile as sf

    return sf.info(io.BytesIO(data)).duration


async def chat(client: httpx.AsyncClient, target: Target, sample: SampleRequest) -> RequestResult:
    content: Any = sample.prompt if not sample.mm_content else [*sample.mm_content,
                                                                {"type": "text", "text": sample.prompt}]
    body = _body(target, sample, messages=[{"role": "user", "content": content}], stream=True,
                 stream_options={"include_usage": True})

    async def read(response: httpx.Response, result: RequestResult) -> None:
        async for chunk in _sse(response):
            _usage(result, chunk)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                audio = (delta.get("audio") or {}).get("data")
                if audio is None and chunk.get("modality") == "audio":
                    audio, delta = delta.get("content"), {}
                if audio:
                    arrival = time.perf_counter() - result.start
                    result.audio_chunks.append((arrival, audio_file_seconds(base64.b64decode(audio))))
                if delta.get("content"):
                    _on_text(result, delta["content"])

    return await _timed(client, target, body, read)


async def completions(client: httpx.AsyncClient, target: Target, sample: SampleRequest) -> RequestResult:
    body = _body(target, sample, prompt=sample.prompt, stream=True, stream_options={"include_usage": True})

    async def read(response: httpx.Response, result: RequestResult) -> None:
        async for chunk in _sse(response):
            _usage(result, chunk)
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    _on_text(result, choice["text"])

    return await _timed(client, target, body, read)


async def speech(client: httpx.AsyncClient, target: Target, sample: SampleRequest) -> RequestResult:
    body = {"model": target.model, "input": sample.prompt, "stream": True, "response_format": "pcm",
            **({"max_new_tokens": sample.output_len} if sample.output_len else {}), **target.extra_body}
    bytes_per_second = 2 * target.sample_rate

    async def read(response: httpx.Response, result: RequestResult) -> None:
        odd = b""  # a 16-bit sample split across two reads
        async for piece in response.aiter_bytes():
            piece, odd = odd + piece, b""
            if len(piece) % 2:
                piece, odd = piece[:-1], piece[-1:]
            if piece:
                result.audio_chunks.append((time.perf_counter() - result.start, len(piece) / bytes_per_second))

    return await _timed(client, target, body, read)


async def images(client: httpx.AsyncClient, target: Target, sample: SampleRequest) -> RequestResult:
    body = {"model": target.model, "prompt": sample.prompt, "n": 1, "response_format": "b64_json",
            **target.extra_body}

    async def read(response: httpx.Response, result: RequestResult) -> None:
        result.images = len(json.loads(await response.aread()).get("data") or [])

    return await _timed(client, target, body, read)


REQUEST_FUNCS: dict[str, RequestFn] = {"openai-chat-omni": chat, "openai-chat": chat, "openai": completions,
                                       "vllm": completions, "openai-audio-speech": speech, "openai-images": images}
