"""`vllm serve --omni` with no MODEL: the embedded tiny demo model answers with text and speech."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.pipeline.conftest import wait_until
from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME


def test_demo_model_answers_a_chat_request(demo_server):  # the session's (tests/conftest.py): fresh cache
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [DEMO_SERVED_NAME]
    resp = client.chat.completions.create(model=DEMO_SERVED_NAME, max_tokens=8,
                                          messages=[{"role": "user", "content": "Hello!"}])
    assert len(resp.choices) == 2  # text and speech
    assert resp.choices[0].message.content is not None and 0 < resp.usage.completion_tokens <= 8
    data, rate = sf.read(io.BytesIO(base64.b64decode(resp.choices[1].message.audio.data)))
    assert rate == 24000 and data.size > 0


def test_vllm_bench_serve_drives_the_demo_server(demo_server, tmp_path):
    """Upstream's benchmark client, `vllm bench serve --omni`, through the real console script: a
    few requests; its figures (tails, warm-up apart, audio playback) printed and saved."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    vllm = Path(sys.executable).with_name("vllm")
    out = subprocess.run([str(vllm), "bench", "serve", "--omni", "--backend", "openai-chat-omni", "--base-url",
                          demo_server.url, "--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "6",
                          "--random-output-len", "3", "--max-concurrency", "2", "--save-result", "--result-dir",
                          str(tmp_path), "--result-filename", "run.json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for line in ("Serving Benchmark Result", "Successful requests:                     3", "P99 E2EL (ms):",
                 "Time to First Packet", "Playback underruns:", "Worst playback gap (ms):", "Warm-up (first 1"):
        assert line in out.stdout, line
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["completed"] == 3 and saved["failed"] == 0 and saved["num_warmup"] == 1
    assert saved["audio_seconds"] > 0 and 0 < saved["total_output"] <= 9  # at most 3 tokens each
    assert {"e2el", "ttft", "audio_ttfp"} <= set(saved["metrics"])


# --- a new user's first requests: the README's, on the demo as it comes -------------------------

def _words(text: str) -> list[str]:
    from vllm_omni.testing import make_tiny_tokenizer
    from vllm_omni.testing.demo_model import demo_words

    vocabulary = {w.strip() for w in demo_words(make_tiny_tokenizer()).values()}
    words = text.split()
    assert text.startswith(" ") and set(words) <= vocabulary, text  # a space before every word, no bytes
    return words


def _speech(client, voice: str, **kw):
    """The README's speech request (max_tokens 32, a wav in choices[1]): (text, samples)."""
    resp = client.chat.completions.create(model=DEMO_SERVED_NAME, audio={"voice": voice, "format": "wav"},
                                          messages=[{"role": "user", "content": "Hello!"}], **kw)
    data, rate = sf.read(io.BytesIO(base64.b64decode(resp.choices[1].message.audio.data)))
    assert rate == 24000
    return resp.choices[0].message.content, data


def test_the_readme_speech_request_speaks_its_words_for_seconds(demo_server):
    from vllm_omni.testing.demo_model import SECONDS_PER_CODE

    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    text, chelsie = _speech(client, "Chelsie", max_tokens=32)
    assert len(_words(text)) == 32  # the demo never ends a reply itself
    assert len(chelsie) / 24000 == pytest.approx(32 * SECONDS_PER_CODE)  # a code per word: 3.2 s
    assert np.sqrt(np.mean(chelsie**2)) > 0.02
    again, ethan = _speech(client, "Ethan", max_tokens=32)
    assert again == text and len(ethan) == len(chelsie)
    assert np.linalg.norm(ethan - chelsie) > 0.3 * np.linalg.norm(chelsie)  # another voice, not the same sound


def test_a_reply_is_short_by_default_and_streams_its_speech_in_chunks(demo_server):
    from vllm_omni.testing.demo_model import DEFAULT_REPLY_TOKENS

    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    text, speech = _speech(client, "Ethan")  # no max_tokens: the demo's own default
    assert len(_words(text)) == DEFAULT_REPLY_TOKENS and len(speech) >= 24000
    stream = client.chat.completions.create(model=DEMO_SERVED_NAME, stream=True, audio={"voice": "Ethan",
                                            "format": "pcm16"}, messages=[{"role": "user", "content": "Hello!"}])
    streamed_text, pcm = "", []
    for chunk in stream:
        for choice in chunk.choices:
            streamed_text += choice.delta.content or ""
            audio = getattr(choice.delta, "audio", None)  # openai's ChoiceDeltaAudio
            if audio is not None and audio.data:
                pcm.append(base64.b64decode(audio.data))
    assert streamed_text == text
    assert len(pcm) >= 3 and sum(map(len, pcm)) == 2 * len(speech)  # several chunks, the same speech


def test_realtime_speaks_the_readme_reply(demo_server):
    import asyncio
    import json

    import websockets

    async def talk() -> tuple[str, bytes]:
        async with websockets.connect(f"ws://127.0.0.1:{demo_server.port}/v1/realtime?model={DEMO_SERVED_NAME}",
                                      max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 32}}))
            transcript, speech = "", b""
            while (event := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] != "response.done":
                assert event["type"] != "error", event
                if event["type"] == "response.output_audio_transcript.delta":
                    transcript += event["delta"]
                elif event["type"] == "response.output_audio.delta":
                    speech += base64.b64decode(event["delta"])
            return transcript, speech

    transcript, speech = asyncio.run(talk())
    assert len(_words(transcript)) == 32 and len(speech) / 48000 >= 1.0  # PCM16 at 24 kHz


def test_a_transcription_is_capped_and_its_stream_counts_as_a_success(demo_server):
    from vllm_omni.testing.demo_model import DEFAULT_REPLY_TOKENS

    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    tone = io.BytesIO()
    sf.write(tone, 0.2 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000), 16000, format="WAV")
    got = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=("q.wav", tone.getvalue()))
    assert got.usage.output_tokens == DEFAULT_REPLY_TOKENS and len(_words(" " + got.text)) == DEFAULT_REPLY_TOKENS
    ok = {"endpoint": "/v1/audio/transcriptions", "status": "200"}
    before = demo_server.metric("vllm_omni:requests_total", **ok) or 0.0
    events = list(client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=("q.wav", tone.getvalue()),
                                                     stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == got.text
    # Counted when the response ends, a moment after the client has read it all.
    assert wait_until(lambda: demo_server.metric("vllm_omni:requests_total", **ok) == before + 1, 10.0)
    assert demo_server.metric("vllm_omni:requests_total", endpoint="/v1/audio/transcriptions", status="499") is None
