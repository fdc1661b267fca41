"""The session's demo server (tests/conftest.py `demo_server`: the embedded tiny Qwen2.5-Omni) for
the realtime, transcription and page tests, and a realtime client over a real WebSocket
(`websockets`)."""
from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import openai
import pytest
import websockets

from tests.conftest import DEMO_MAX_HISTORY_AUDIO_S, DEMO_MAX_INPUT_AUDIO_S
from tests.server.conftest import ServerProcess
from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME

MAX_INPUT_AUDIO_S = DEMO_MAX_INPUT_AUDIO_S  # --realtime-max-input-audio-s of the demo server
MAX_HISTORY_AUDIO_S = DEMO_MAX_HISTORY_AUDIO_S
EVENT_TIMEOUT_S = 90.0  # one event; generous for a loaded 2-core machine


@pytest.fixture(scope="session")
def demo(demo_server):
    return demo_server


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ws_url(server: ServerProcess, model: str | None = DEMO_SERVED_NAME) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime" + (f"?model={model}" if model else "")


class Realtime:
    """A realtime session seen from the client: send events, read events until one arrives."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, server: ServerProcess, **session: Any) -> Realtime:
        rt = cls(await websockets.connect(ws_url(server), max_size=None))
        created = await rt.until("session.created")
        assert created["session"]["model"] == DEMO_SERVED_NAME
        if session:
            await rt.update(**session)
        return rt

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def update(self, **session: Any) -> dict[str, Any]:
        await self.send("session.update", session=session)
        return (await self.until("session.updated"))["session"]

    async def recv(self) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), EVENT_TIMEOUT_S))
        self.seen.append(event)
        return event

    async def until(self, kind: str) -> dict[str, Any]:
        """Read events up to the first of type `kind`; an unexpected `error` fails the test."""
        while True:
            event = await self.recv()
            if event["type"] == kind:
                return event
            assert event["type"] != "error", event

    async def first(self, kind: str) -> dict[str, Any]:
        """The first event of type `kind`, whether it already arrived (events of a live session
        interleave: under load it may come before the one the test waited for) or is still to come."""
        for event in self.seen:
            if event["type"] == kind:
                return event
        return await self.until(kind)

    async def error(self) -> dict[str, Any]:
        while True:
            event = await self.recv()
            if event["type"] == "error":
                return event["error"]

    async def say_text(self, text: str) -> dict[str, Any]:
        """A user text item; returns it as the server added it."""
        await self.send("conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return (await self.until("conversation.item.done"))["item"]

    async def response(self, **params: Any) -> Reply:
        """response.create, then everything up to response.done."""
        await self.send("response.create", **({"response": params} if params else {}))
        return await self.reply()

    async def reply(self) -> Reply:
        start = len(self.seen)
        done = await self.until("response.done")
        return Reply(self.seen[start:], done["response"])

    async def close(self) -> None:
        await self.ws.close()


class Reply:
    def __init__(self, events: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self.events, self.response = events, response

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def transcript(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_audio_transcript.delta"))

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_text.delta"))

    @property
    def pcm(self) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in self.of("response.output_audio.delta"))

    @property
    def item(self) -> dict[str, Any]:
        return self.response["output"][0]


def chat_reference(client: openai.OpenAI, messages: list[dict], max_tokens: int, voice: str | None = None,
                   modalities: list[str] | None = None) -> tuple[str, bytes]:
    """What /v1/chat/completions answers for the same conversation: (text, pcm16 bytes)."""
    audio = {"format": "pcm16", **({"voice": voice} if voice else {})}
    resp = client.chat.completions.create(model=DEMO_SERVED_NAME, messages=messages, max_tokens=max_tokens,
                                          audio=audio, **({"modalities": modalities} if modalities else {}))
    text = resp.choices[0].message.content
    pcm = base64.b64decode(resp.choices[1].message.audio.data) if len(resp.choices) > 1 else b""
    return text, pcm


def user_text(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def user_audio_wav(b64: str) -> dict:
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}


def run(coro):
    return asyncio.run(coro)


def chunks(wave: np.ndarray, n: int) -> list[np.ndarray]:
    return [c for c in np.array_split(wave, n) if c.size]
