"""Stored voices (/v1/audio/voices) and the speech socket (/v1/audio/speech/stream) on one real
`vllm-omni serve` of the tiny Qwen3-TTS Base checkpoint (greedy, so equal inputs give equal
audio), with --api-key, through real sockets (`openai`, httpx, `websockets`); the server is
shared with test_voices_upstream.py (`voices_server`, conftest.py and voices_server.py):

- a voice is made, listed, used, and deleted; it speaks exactly (PCM16, byte for byte) as its
  reference passed inline, in-context and x-vector-only;
- abuse: path-like and reserved names, a taken name, oversized and over-long samples, no audio,
  missing transcript, the voice count cap, a voice of another checkpoint (refused with the
  reason), and no API key;
- the socket: a client that writes text at speaking pace hears the first audio before its text
  ends; the chunks' text spans run in order over the whole text; the speech equals that of the
  whole text spoken at once (the talker waits for text: max_frames_per_token 0); the
  docs/tts.md examples run as written; a too-large message, too much text and an idle client
  end the session;
- the page's speech tab (headless Chromium) speaks and makes voices;
- a voice written to the folder before the server started (by the store, in the test process)
  is listed and speaks as its reference inline: voices outlive the server.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
import soundfile as sf
import websockets

from tests.server.conftest import REPO, ServerProcess
from tests.server.voices_server import (
    DOCS, IDLE_S, KEY, MAX_FRAME_BYTES, MAX_TEXT_CHARS, MAX_VOICES, PHRASES, REF_TEXT, SPF, Client, error_of, wav_bytes,
    words, ws_url,
)


@pytest.fixture(scope="module")
def client(voices_server):
    return Client(voices_server["server"])


def test_a_voice_is_made_listed_used_and_deleted(client):
    wav = wav_bytes(1.2)
    made = client.make("alice", wav, ref_text=REF_TEXT)
    assert made.status_code == 200, made.text
    ours = {k: v for k, v in made.json().items() if k not in ("success", "voice")}  # (upstream's: at the end)
    assert ours | {"created_at": 0} == {"id": "alice", "object": "audio.voice", "name": "alice", "kind": "cloned",
                                        "created_at": 0, "ref_text": REF_TEXT, "audio_seconds": 1.2,
                                        "mode": "in_context", "mime_type": "audio/wav", "file_size": len(wav)}
    assert client.make("bob", wav, x_vector_only_mode="true").json()["mode"] == "x_vector_only"
    listed = client.http.get("/v1/audio/voices").json()
    assert listed["voices"] == ["alice", "bob", "dora"] and listed["task_type"] == "Base"
    assert [(v["name"], v["kind"]) for v in listed["data"]] == [("alice", "cloned"), ("bob", "cloned"),
                                                                 ("dora", "cloned")]
    assert client.http.get("/v1/audio/voices/ALICE").json()["name"] == "alice"  # names match ignoring case

    inline = client.speak(ref_audio=base64.b64encode(wav).decode(), ref_text=REF_TEXT)
    assert len(inline) > 0 and client.speak(voice="alice") == inline
    inline_xvector = client.speak(ref_audio=base64.b64encode(wav).decode(), x_vector_only_mode=True)
    assert client.speak(voice="bob") == inline_xvector != inline

    deleted = client.http.delete("/v1/audio/voices/bob")
    assert deleted.json() == {"id": "bob", "object": "audio.voice.deleted", "deleted": True, "success": True,
                              "message": "Voice 'bob' deleted successfully"}
    assert client.http.get("/v1/audio/voices/bob").status_code == 404
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'bob'; stored voices: \['alice', 'dora'\]"):
        client.speak(voice="bob")
    with pytest.raises(openai.BadRequestError, match="stored voice: give no ref_audio"):
        client.speak(voice="alice", ref_audio=base64.b64encode(wav).decode(), ref_text=REF_TEXT)


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "x" * 65, "ünïcode", "a b"])
def test_names_that_are_paths_or_odd_are_refused(client, name, voices_server):
    response = client.make(name, wav_bytes(1.0), ref_text=REF_TEXT)
    assert response.status_code == 400 and "voice names are" in error_of(response), response.text
    assert sorted(p.name for p in (voices_server["tmp"] / "voices").iterdir()) == ["alice.safetensors", "dora.safetensors",
                                                                         "elsewhere.safetensors"]


def test_abuse_is_refused_with_the_reason(client):
    wav = wav_bytes(1.0)
    cases = [
        (client.make("alice", wav, ref_text=REF_TEXT), 409, "exists"),
        (client.make("big", wav_bytes(2.9, rate=48000), ref_text=REF_TEXT), 413, "--max-voice-bytes"),
        (client.make("long", wav_bytes(3.5, rate=8000), ref_text=REF_TEXT), 400, "--max-voice-audio-s"),
        (client.make("noise", b"RIFF not a wav at all" * 10, ref_text=REF_TEXT), 400, "cannot use the voice sample"),
        (client.make("mute", None, ref_text=REF_TEXT), 400, "'audio_sample'"),
        (client.make("silent", wav), 400, "'ref_text'"),
        (client.make("styled", wav, ref_text=REF_TEXT, instructions="warm"), 400, "takes no instructions"),
        (client.make("extra", wav, ref_text=REF_TEXT, colour="red"), 400, "unsupported parameter 'colour'"),
        (client.http.get("/v1/audio/voices/elsewhere"), 409, "made for another checkpoint (other-model"),
        (client.http.delete("/v1/audio/voices/elsewhere"), 409, "made for another checkpoint"),
        (client.make("elsewhere", wav, ref_text=REF_TEXT), 409, "exists"),
        (client.http.get("/v1/audio/voices/nobody"), 404, "no voice 'nobody'"),
        (httpx.get(f"{client.server.url}/v1/audio/voices"), 401, "API key"),
        (httpx.post(f"{client.server.url}/v1/audio/voices", data={"name": "x"}), 401, "API key"),
    ]
    for response, status, message in cases:
        assert response.status_code == status and message in error_of(response), response.text
    with pytest.raises(openai.BadRequestError, match="made for another checkpoint"):
        client.speak(voice="elsewhere")
    held = len(client.http.get("/v1/audio/voices").json()["voices"]) + 1  # and elsewhere's
    made = [client.make(f"v{i}", wav, x_vector_only_mode="true") for i in range(MAX_VOICES - held + 1)]
    assert [r.status_code for r in made] == [200] * (MAX_VOICES - held) + [400]
    assert "--max-voices" in error_of(made[-1])
    for i in range(MAX_VOICES - held):
        assert client.http.delete(f"/v1/audio/voices/v{i}").status_code == 200


# ------------------------------------------------------------------ the speech socket

FLUSH = None  # a piece of stream_session: input_text.flush


async def stream_session(server: ServerProcess, pieces: list[str | None], pace_s: float, **session) -> dict:
    """Send the pieces `pace_s` apart, then input_text.end; collect every event until the close."""
    got: dict = {"events": [], "last_text_at": None, "first_audio_at": None}
    async with websockets.connect(ws_url(server), additional_headers={"Authorization": f"Bearer {KEY}"},
                                  max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": session}))

        async def write() -> None:
            for piece in pieces:
                event = {"type": "input_text.flush"} if piece is FLUSH else {"type": "input_text.append", "text": piece}
                await ws.send(json.dumps(event))
                await asyncio.sleep(pace_s)
            got["last_text_at"] = time.monotonic()
            await ws.send(json.dumps({"type": "input_text.end"}))

        writer = asyncio.create_task(write())
        async for message in ws:
            event = json.loads(message)
            got["events"].append(event)
            if event["type"] == "speech.audio.delta" and got["first_audio_at"] is None:
                got["first_audio_at"] = time.monotonic()
        await writer
    return got


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


@pytest.mark.parametrize("pace_s", [0.4, 0.0], ids=["speaking-pace", "at-once"])
def test_text_at_speaking_pace_is_heard_before_it_ends_and_speaks_as_the_whole_text(client, pace_s):
    """At once, phrases are appended before the request is even submitted (AsyncOmni keeps them
    in order until it is)."""
    text = "".join(PHRASES)
    got = asyncio.run(stream_session(client.server, words(text), pace_s, voice="dora", max_frames_per_token=0))
    assert of(got["events"], "error") == []
    assert got["first_audio_at"] is not None and (pace_s == 0 or got["first_audio_at"] < got["last_text_at"])
    deltas, done = of(got["events"], "speech.audio.delta"), of(got["events"], "speech.audio.done")
    assert len(done) == 1 and done[0]["status"] == "completed"
    assert (done[0]["text_start"], done[0]["text_end"]) == (0, len(text))
    spans = [(d["text_start"], d["text_end"]) for d in deltas]
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # in order, no gap
    assert all(s <= e for s, e in spans) and spans[-1][1] <= len(text)
    pcm = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    assert len(pcm) % (2 * SPF) == 0 and done[0]["usage"]["output_tokens"] == len(pcm) // (2 * SPF)
    # The talker waited for each phrase and kept its context: the speech of the whole text at once.
    assert pcm == client.speak(text, voice="dora", non_streaming_mode=False)


def test_each_flush_ends_an_utterance_and_the_next_text_starts_another(client):
    # (the flushes come while the first utterance is still being spoken: each ends its own)
    got = asyncio.run(stream_session(client.server, ["Hi there", FLUSH, " and again.", FLUSH, " Third."], 0.0,
                                     voice="dora", sampling={"max_tokens": 12}))
    done = of(got["events"], "speech.audio.done")
    assert [d["status"] for d in done] == ["completed"] * 3
    assert [(d["text_start"], d["text_end"]) for d in done] == [(0, 8), (8, 19), (19, 26)]
    assert len({d["utterance_id"] for d in done}) == 3
    assert all(d["usage"]["output_tokens"] <= 12 for d in done)


def test_docs_examples_run_as_written(client, tmp_path):
    """The two socket examples of docs/tts.md, against this server (its address and key)."""
    blocks = re.findall(r"```python\n(# speech socket example.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 2
    if client.http.get("/v1/audio/voices/alice").status_code == 404:  # the examples speak as alice
        assert client.make("alice", wav_bytes(1.2), ref_text=REF_TEXT).status_code == 200
    for i, code in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(code.replace("localhost:8000", f"127.0.0.1:{client.server.port}").replace(
            'api_key="none"', f'api_key="{KEY}"').replace("Bearer none", f"Bearer {KEY}"))
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        audio, rate = sf.read(tmp_path / "speech.wav")
        assert rate == 24000 and audio.size > 0
        (tmp_path / "speech.wav").unlink()


def test_the_socket_bounds(client):
    async def go():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "input_text.append", "text": "x" * MAX_FRAME_BYTES}))
            error = json.loads(await ws.recv())
            await ws.wait_closed()
            big = (error["error"]["code"], ws.close_code)
        async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
            await ws.recv()
            for _ in range(MAX_TEXT_CHARS // 1000 + 1):
                await ws.send(json.dumps({"type": "input_text.append", "text": "word " * 200}))
            events = []
            with pytest.raises(websockets.ConnectionClosedError):
                while True:
                    events.append(json.loads(await ws.recv()))
            too_much = ([e["error"]["code"] for e in events if e["type"] == "error"], ws.close_code)
        async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": "nobody"}}))
            unknown = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "input_text.push", "text": "x"}))
            bad_type = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "session.update", "session": {"language": "Klingon"}}))
            language = json.loads(await ws.recv())
            started = time.monotonic()
            idle = json.loads(await asyncio.wait_for(ws.recv(), IDLE_S + 30))
            await ws.wait_closed()
            idle_after = time.monotonic() - started
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(ws_url(client.server))
        return big, too_much, unknown, bad_type, language, idle, idle_after

    big, too_much, unknown, bad_type, language, idle, idle_after = asyncio.run(go())
    assert "unsupported language 'Klingon'" in language["error"]["message"]
    assert idle["error"]["code"] == "session_idle_timeout" and IDLE_S - 1 < idle_after < IDLE_S + 30
    assert big == ("message_too_big", 1009)
    assert too_much == (["input_text_too_long"], 1008)
    assert unknown["type"] == "error" and "unknown voice 'nobody'" in unknown["error"]["message"]
    assert bad_type["error"]["code"] == "unknown_event_type"


# ------------------------------------------------------------------ the page's speech tab

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_SCREENSHOT = REPO / "docs" / "images" / "speech-tab.png"  # written with UPDATE_DOCS_SCREENSHOTS=1


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (.ci/run installs Debian's)")
def test_the_speech_tab_speaks_and_makes_voices(client, tmp_path):
    """Headless Chromium (tests/realtime/test_voice_chat_page.py's setup) on this server: after
    the API key, the page opens on the speech tab, speaks typed text with a stored voice as it
    streams, and makes voices from a file and from the (fake) microphone."""
    from playwright.sync_api import sync_playwright

    from tests.realtime.test_voice_chat_page import FLAGS

    sample = tmp_path / "sample.wav"
    sample.write_bytes(wav_bytes(1.0, pitch=220.0))
    text = "Good morning! The sun is out, so let us walk to the park."
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 620})
            console = []
            page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(str(e)))
            page.goto(client.server.url + "/")
            page.wait_for_function("window.voiceChat.state.errors.some(e => e.includes('API key'))", timeout=30_000)
            page.click("#chat-pane .settings details > summary")
            page.fill("#apikey", KEY)
            page.click("#reconnect")
            page.wait_for_function("window.voiceChat.state.tab === 'speech' && window.voiceChat.speech.voices.length > 0",
                                   timeout=30_000)
            speech = lambda key: page.evaluate(f"window.voiceChat.speech.{key}")  # noqa: E731
            assert ("dora", "cloned") in [(v["name"], v["kind"]) for v in speech("voices")]
            assert page.locator("#chat-pane").is_hidden() and page.locator("#tab-chat").is_hidden()

            page.select_option("#speech-voice", "dora")
            page.fill("#speech-text", text)
            page.click("#speak")
            page.wait_for_function("window.voiceChat.speech.status === 'done'", timeout=120_000)
            page.wait_for_function("window.voiceChat.speech.chunksPlayed >= window.voiceChat.speech.deltas",
                                   timeout=30_000)
            assert speech("deltas") >= 1 and speech("samplesPlayed") == speech("samplesReceived") > 0
            assert speech("spokenTo") == len(text) and page.locator("#spoken b").inner_text() == text

            page.click("#voice-maker > summary")
            page.fill("#new-voice-name", "fromfile")
            page.set_input_files("#new-voice-file", str(sample))
            page.fill("#new-voice-text", REF_TEXT)
            page.click("#make-voice")
            page.wait_for_function("window.voiceChat.speech.made.includes('fromfile')", timeout=60_000)
            page.set_input_files("#new-voice-file", [])
            page.click("#record-voice")
            page.wait_for_timeout(1200)
            page.click("#record-voice")
            page.wait_for_function("window.voiceChat.speech.recordedBytes > 0", timeout=10_000)
            page.fill("#new-voice-name", "frommic")
            page.click("#make-voice")
            page.wait_for_function("window.voiceChat.speech.made.includes('frommic')", timeout=60_000)
            assert page.input_value("#speech-voice") == "frommic"
            assert speech("errors") == [e for e in speech("errors") if "API key" in e]
            assert [e for e in console if "status of 401" not in e and "403" not in e] == []
            docs = os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1"  # else the tracked image stays as it is
            page.screenshot(path=str(DOCS_SCREENSHOT if docs else tmp_path / "speech-tab.png"))
        finally:
            browser.close()
    assert client.http.get("/v1/audio/voices/frommic").json()["audio_seconds"] > 0.5
    for name in ("fromfile", "frommic"):
        assert client.http.delete(f"/v1/audio/voices/{name}").status_code == 200


def test_a_voice_made_before_the_server_started_is_served(client):
    """The folder outlives the server: `dora` was written by an earlier process (the fixture)."""
    assert client.http.get("/v1/audio/voices/dora").json()["mode"] == "in_context"
    inline = client.speak(ref_audio=base64.b64encode(wav_bytes(1.5, pitch=190.0)).decode(), ref_text=REF_TEXT)
    assert client.speak(voice="dora") == inline
