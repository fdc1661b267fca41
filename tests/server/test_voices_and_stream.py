"""Stored voices (/v1/audio/voices) and the speech socket (/v1/audio/speech/stream) on one real
`vllm-omni serve` of the tiny Qwen3-TTS Base checkpoint (greedy, so equal inputs give equal
audio), with --api-key, through real sockets (`openai`, httpx, `websockets`):

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
- a voice written to the folder before the server started (by the store, in the test process)
  is listed and speaks as its reference inline: voices outlive the server;
- upstream vLLM-Omni's clients: the socket's upstream dialect (its events, binary audio, an
  inline reference, refused fields, the caps), its voice fields and answer shapes, a sample
  that decodes past the voice cap (stopped while decoding), and POST /v1/audio/speech/batch.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets

from tests.conftest import in_threads
from tests.server.conftest import REPO, ServerProcess

KEY = "voices-key"
FRAMES = 40  # codec frames per utterance at most (greedy, EOS seldom comes first with these weights)
# Both stages run as threads of the server (nothing here is about stage processes).
OVERRIDES = json.dumps(in_threads(2, {
    "0": {"max_num_seqs": 4, "default_sampling_params": {"max_tokens": FRAMES, "temperature": 0.0}},
    "1": {"max_num_seqs": 4}}))
MAX_VOICE_BYTES = 120_000
MAX_VOICE_AUDIO_S = 3
MAX_VOICES = 5
MAX_TEXT_CHARS = 2000
MAX_FRAME_BYTES = 4096
MAX_BATCH_ITEMS = 3
LSB_SLACK = 4  # PCM16 steps between a batched item and the same request alone (float rounding only)
IDLE_S = 4  # --realtime-idle-timeout-s (the socket shares the realtime session limits)
REF_TEXT = "Hello there."
SPF = 1920  # samples per codec frame
# Phrases whose tokens are those of the whole text (each later phrase starts with its space).
PHRASES = ["Good morning, my friend.", " The sun is out today.", " Let us walk to the park!"]
DOCS = REPO / "docs" / "tts.md"


def wav_bytes(seconds: float, rate: int = 16000, pitch: float = 150.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.4 * np.sin(2 * np.pi * pitch * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t)), rate, format="WAV")
    return buf.getvalue()


def foreign_voice(folder: Path) -> None:
    """A voice file made on another checkpoint (another encoder fingerprint)."""
    from safetensors.torch import save_file
    import torch

    record = {"name": "elsewhere", "kind": "cloned", "fingerprint": "0" * 32, "created_at": 1, "model": "other-model",
              "instructions": None, "audio_seconds": 1.0, "ref_text": None}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"speaker": torch.zeros(64)}, str(folder / "elsewhere.safetensors"),
              metadata={"vllm_omni_voice": json.dumps(record)})


def earlier_voice(ckpt: Path, folder: Path) -> None:
    """`dora`, made as a server would have made it, before this server starts."""
    from vllm_omni.entrypoints.openai.serving_voices import decode_sample
    from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
    from vllm_omni.entrypoints.openai.voices_store import StoredVoice, VoiceStore
    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder, voice_fingerprint
    from vllm_omni.multimodal.qwen3_tts_voices import Qwen3TTSVoiceCloning

    store = VoiceStore.open(VoiceLimits(folder), voice_fingerprint(ckpt), str(ckpt))
    wave = decode_sample(Qwen3TTSVoiceCloning, wav_bytes(1.5, pitch=190.0), 10.0)
    cloned = VoiceEncoder.load(ckpt).encode(wave, REF_TEXT)
    store.add(StoredVoice("dora", "cloned", store.fingerprint, model=str(ckpt), audio_seconds=1.5, cloned=cloned), [])


def launch(ckpt: Path, voices: Path, log: Path) -> ServerProcess:
    return ServerProcess.launch([
        str(ckpt), "--served-model-name", "tts", "--api-key", KEY, "--stage-overrides", OVERRIDES,
        "--voices-dir", str(voices), "--max-voices", str(MAX_VOICES), "--max-voice-bytes", str(MAX_VOICE_BYTES),
        "--max-voice-audio-s", str(MAX_VOICE_AUDIO_S), "--speech-stream-max-text-chars", str(MAX_TEXT_CHARS),
        "--speech-stream-max-frame-bytes", str(MAX_FRAME_BYTES), "--realtime-idle-timeout-s", str(IDLE_S),
        "--speech-batch-max-items", str(MAX_BATCH_ITEMS)],
        log).wait_ready()


@pytest.fixture(scope="module")
def tts(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("voices-server")
    foreign_voice(tmp / "voices")
    ckpt = tiny_model("qwen3_tts", task_type="Base")
    earlier_voice(ckpt, tmp / "voices")
    state = {"server": launch(ckpt, tmp / "voices", tmp / "server.log"), "ckpt": ckpt, "tmp": tmp}
    yield state
    state["server"].stop()


class Client:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        self.openai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def make(self, name: str, audio: bytes | None = None, **fields) -> httpx.Response:
        files = {"audio_sample": ("sample.wav", audio, "audio/wav")} if audio is not None else None
        return self.http.post("/v1/audio/voices", data={"name": name, **fields}, files=files)

    def speak(self, text: str = "How are you today?", voice: str = "alloy", **extra) -> bytes:
        return self.openai.audio.speech.create(model="tts", input=text, voice=voice, response_format="pcm",
                                               extra_body=extra or None).content


@pytest.fixture(scope="module")
def client(tts):
    return Client(tts["server"])


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


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
def test_names_that_are_paths_or_odd_are_refused(client, name, tts):
    response = client.make(name, wav_bytes(1.0), ref_text=REF_TEXT)
    assert response.status_code == 400 and "voice names are" in error_of(response), response.text
    assert sorted(p.name for p in (tts["tmp"] / "voices").iterdir()) == ["alice.safetensors", "dora.safetensors",
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

def ws_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream"


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


def words(text: str) -> list[str]:
    return re.findall(r"\S+\s*", text)


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


# ------------------------------------------------------------------ the socket in upstream vLLM-Omni's dialect

async def upstream_session(server: ServerProcess, messages: list[dict]) -> list[dict | bytes]:
    """Send upstream's messages (session.config first), then read every frame (JSON or binary)
    until the server closes."""
    frames: list[dict | bytes] = []
    async with websockets.connect(ws_url(server), additional_headers={"Authorization": f"Bearer {KEY}"},
                                  max_size=None) as ws:
        for message in messages:
            await ws.send(json.dumps(message))
        async for frame in ws:
            frames.append(frame if isinstance(frame, bytes) else json.loads(frame))
    return frames


def test_upstream_clients_speak_on_the_same_socket(client):
    """Upstream's client messages (session.config, input.text, input.done, session.close) get
    upstream's answers (audio.start, binary audio, audio.done, session.done per input.done), from
    the same session engine: the streamed PCM is the speech of the whole text at once, and a
    non-streamed utterance comes as one WAV file."""
    text, second = "".join(PHRASES), "See you soon."
    messages = [{"type": "session.config", "model": "tts", "task_type": "Base", "voice": "dora",
                 "response_format": "pcm", "stream_audio": True},
                *({"type": "input.text", "text": w} for w in words(text)), {"type": "input.done"},
                {"type": "session.config", "voice": "dora", "split_granularity": "sentence"},  # wav, one file
                {"type": "input.text", "text": second}, {"type": "input.done"},
                {"type": "input.done"},  # nothing to say: answered at once
                {"type": "session.close"}]
    frames = asyncio.run(upstream_session(client.server, messages))
    assert frames[0]["type"] == "session.created"  # ours, sent before the client chose its dialect
    shape = [f["type"] if isinstance(f, dict) else "bytes" for f in frames[1:]]
    first_end = shape.index("audio.done")
    assert shape[0] == "audio.start" and set(shape[1:first_end]) == {"bytes"}
    assert shape[first_end:] == ["audio.done", "session.done", "audio.start", "bytes", "audio.done", "session.done",
                                 "session.done"]
    json_frames = [f for f in frames[1:] if isinstance(f, dict)]
    assert json_frames[0] == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                              "sentence_text": json_frames[0]["sentence_text"], "format": "pcm",
                              "sample_rate": 24000, "channels": 1}
    assert text.startswith(json_frames[0]["sentence_text"])
    assert json_frames[1:] == [
        {"type": "audio.done", "utterance_index": 0, "sentence_index": 0},
        {"type": "session.done", "utterance_index": 0, "total_sentences": 1},
        {"type": "audio.start", "utterance_index": 1, "sentence_index": 0, "sentence_text": second, "format": "wav"},
        {"type": "audio.done", "utterance_index": 1, "sentence_index": 0},
        {"type": "session.done", "utterance_index": 1, "total_sentences": 1},
        {"type": "session.done", "utterance_index": 2, "total_sentences": 0}]
    streamed = b"".join(frames[2:first_end + 1])
    assert streamed == client.speak(text, voice="dora", non_streaming_mode=False)
    wave, rate = sf.read(io.BytesIO(frames[first_end + 4]), dtype="int16")
    expected = np.frombuffer(client.speak(second, voice="dora", non_streaming_mode=False), dtype="<i2")
    assert rate == 24000 and wave.shape == expected.shape and np.abs(wave.astype(int) - expected).max() <= 1


def test_upstream_fields_are_refused_by_name_and_the_caps_hold(client):
    async def go():
        headers = {"Authorization": f"Bearer {KEY}"}
        answers = []
        for config in ({"speaker_embedding": [0.1, 0.2]}, {"speed": 1.5},
                       {"response_format": "mp3", "stream_audio": True}, {"word_timestamps": True},
                       {"task_type": "CustomVoice"}, {"ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "hi"}):
            async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "session.config", **config}))
                answers.append(json.loads(await ws.recv()))
        async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.config", "voice": "dora"}))
            await ws.send(json.dumps({"type": "input.text", "text": "x" * MAX_FRAME_BYTES}))
            big = json.loads(await ws.recv())
            await ws.wait_closed()
            return answers, big, ws.close_code

    answers, big, close_code = asyncio.run(go())
    assert all(a["type"] == "error" and set(a) >= {"message", "code"} for a in answers)
    assert "'speaker_embedding'" in answers[0]["message"] and "POST /v1/audio/voices" in answers[0]["message"]
    assert answers[1]["param"] == "speed" and answers[2]["param"] == "response_format"
    assert "'word_timestamps'" in answers[3]["message"]
    assert answers[4]["param"] == "task_type" and "Base checkpoint" in answers[4]["message"]
    assert answers[5]["param"] == "ref_audio" and "cannot use the voice sample" in answers[5]["message"]
    assert (big["code"], close_code) == ("message_too_big", 1009)


# ------------------------------------------------------------------ /v1/audio/voices as upstream's clients use it

def test_upstream_voice_fields_are_stored_listed_and_answered_in_upstreams_shape(client, tts):
    """Upstream's upload (audio_sample, consent, name, ref_text, speaker_description) answers
    {"success": true, "voice": {...}} beside our voice object; GET lists `uploaded_voices`;
    DELETE answers `success`; the fields outlive the process (read back from the folder)."""
    from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
    from vllm_omni.entrypoints.openai.voices_store import VoiceStore
    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import voice_fingerprint

    audio = wav_bytes(1.2, pitch=170.0)
    made = client.make("upstreamer", audio, consent="consent-rec-42", ref_text=REF_TEXT,
                       speaker_description="a calm low voice")
    assert made.status_code == 200, made.text
    body = made.json()
    upstream = {"name": "upstreamer", "consent": "consent-rec-42", "created_at": body["created_at"],
                "file_size": len(audio), "mime_type": "audio/wav", "ref_text": REF_TEXT,
                "speaker_description": "a calm low voice"}
    assert body["success"] is True and body["voice"] == upstream
    assert body["object"] == "audio.voice" and body["kind"] == "cloned" and body["consent"] == "consent-rec-42"
    listed = client.http.get("/v1/audio/voices").json()
    assert upstream in listed["uploaded_voices"] and "upstreamer" in listed["voices"]
    assert client.http.get("/v1/audio/voices/upstreamer").json()["speaker_description"] == "a calm low voice"
    ckpt = tts["ckpt"]
    reread = VoiceStore.open(VoiceLimits(tts["tmp"] / "voices"), voice_fingerprint(ckpt), str(ckpt)).get("upstreamer")
    assert reread.upstream() == upstream
    too_long = client.make("upstreamer2", audio, consent="c" * 300, ref_text=REF_TEXT)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "consent"
    embedding = client.http.post("/v1/audio/voices", data={"name": "emb", "consent": "c",
                                                           "speaker_embedding": "[0.1, 0.2]"})
    assert embedding.status_code == 400 and "'speaker_embedding'" in error_of(embedding)
    deleted = client.http.delete("/v1/audio/voices/upstreamer").json()
    assert deleted["success"] is True and deleted["deleted"] is True and "upstreamer" in deleted["message"]


# ------------------------------------------------------------------ the sample goes through the media gate

def lying_flac() -> bytes:
    """15 minutes of FLAC silence (~20 kB) whose STREAMINFO declares 1 s, behind an ID3 tag:
    libsndfile refuses it, FFmpeg decodes all of it whatever the header says."""
    from tests.multimodal.media_files import flac_bomb

    flac = bytearray(flac_bomb(0.25))
    info = int.from_bytes(flac[18:26], "big") & ~((1 << 36) - 1) | 8000  # total samples: 1 s at 8 kHz
    flac[18:26] = info.to_bytes(8, "big")
    return b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(flac)


def test_a_sample_decoding_past_the_cap_stops_at_the_voice_cap(client):
    """The decoder stops at --max-voice-audio-s (the media gate's limit while decoding), not at the
    server-wide --max-audio-duration, whatever duration the file declares."""
    made = client.make("bomb", lying_flac(), ref_text=REF_TEXT)
    assert made.status_code == 400
    assert f"longer than {MAX_VOICE_AUDIO_S} s" in error_of(made) and "--max-voice-audio-s" in error_of(made)


# ------------------------------------------------------------------ POST /v1/audio/speech/batch (upstream's route)

def test_a_batch_speaks_each_item_as_its_own_request_with_per_item_errors(client):
    """Batch fields are each item's defaults (an item's own win); each result is the file its
    single request gives; a failing item is its own result; the item cap is a flag."""
    items = [{"input": PHRASES[0]}, {"input": "Nobody speaks.", "voice": "nobody"},
             {"input": PHRASES[1], "response_format": "pcm"}]
    answer = client.http.post("/v1/audio/speech/batch", json={"model": "tts", "voice": "dora", "items": items})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["total"], body["succeeded"], body["failed"]) == (3, 2, 1) and body["id"].startswith("speech-batch-")
    first, refused, third = body["results"]
    assert [r["index"] for r in body["results"]] == [0, 1, 2]
    assert refused["status"] == "error" and "unknown voice 'nobody'" in refused["error"] and refused["code"] == 400
    assert third["status"] == "success" and third["media_type"] == "audio/pcm"
    # (items run batched together: the decoder's float sums may round apart by an LSB or so)
    pcm = np.frombuffer(base64.b64decode(third["audio_data"]), dtype="<i2").astype(int)
    alone = np.frombuffer(client.speak(PHRASES[1], voice="dora"), dtype="<i2")
    assert pcm.shape == alone.shape and np.abs(pcm - alone).max() <= LSB_SLACK, np.abs(pcm - alone).max()
    assert first["status"] == "success" and first["media_type"] == "audio/wav"  # upstream's batch default
    wave, rate = sf.read(io.BytesIO(base64.b64decode(first["audio_data"])), dtype="int16")
    expected = np.frombuffer(client.speak(PHRASES[0], voice="dora"), dtype="<i2")
    assert rate == 24000 and wave.shape == expected.shape
    assert np.abs(wave.astype(int) - expected).max() <= LSB_SLACK, np.abs(wave.astype(int) - expected).max()
    assert first["usage"]["output_tokens"] == expected.size // SPF

    too_many = client.http.post("/v1/audio/speech/batch", json={"items": [{"input": "Hi."}] * (MAX_BATCH_ITEMS + 1)})
    assert too_many.status_code == 413 and "--speech-batch-max-items" in error_of(too_many)
    unknown = client.http.post("/v1/audio/speech/batch",
                               json={"items": [{"input": "Hi.", "initial_codec_chunk_frames": 4}]})
    assert unknown.status_code == 400 and "initial_codec_chunk_frames" in error_of(unknown)
    other = client.http.post("/v1/audio/speech/batch", json={"model": "nope", "items": [{"input": "Hi."}]})
    assert other.status_code == 404


def test_upstream_clients_clone_a_voice_inline_in_the_session_config(client):
    """Upstream's Base clients send ref_audio / ref_text in session.config: the session's voice is
    encoded once, as a stored voice is, and speaks as the same reference given inline."""
    wav, text = wav_bytes(0.3, rate=4000, pitch=160.0), "How are you today?"  # (within the frame cap)
    reference = {"ref_audio": base64.b64encode(wav).decode(), "ref_text": REF_TEXT}
    frames = asyncio.run(upstream_session(client.server, [
        {"type": "session.config", "response_format": "pcm", "stream_audio": True, **reference},
        {"type": "input.text", "text": text}, {"type": "input.done"}, {"type": "session.close"}]))
    assert not [f for f in frames if isinstance(f, dict) and f["type"] == "error"], frames
    streamed = b"".join(f for f in frames if isinstance(f, bytes))
    assert streamed == client.speak(text, voice="alloy", non_streaming_mode=False, **reference)
    refused = asyncio.run(upstream_session(client.server, [
        {"type": "session.config", "ref_audio": reference["ref_audio"]}, {"type": "session.close"}]))
    assert [f["param"] for f in refused if isinstance(f, dict) and f["type"] == "error"] == ["ref_text"]
