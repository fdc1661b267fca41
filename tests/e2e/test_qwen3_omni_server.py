"""Qwen3-Omni through the API server: a real `vllm-omni serve <tiny Qwen3-Omni dir>` subprocess
(bundled config, its three stages as threads of the server) and the official `openai` client.

8 concurrent chat requests with speech out (text, audio+text, image+text) each equal their
solo request: the same text and the same encoded audio bytes. The talker samples (bundled
defaults: temperature 0.9, top-k 50, seed 42), so this also shows per-request seeding holds
in a shared batch.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.conftest import in_threads
from tests.multimodal.media_files import audio_bytes, image_bytes
from tests.server.conftest import ServerProcess

NAME = "tiny-qwen3-omni"
SR = 24000
# Short outputs keep the module fast: 8 thinker tokens, 16 talker frames.
OVERRIDES = {"0": {"default_sampling_params": {"max_tokens": 8}},
             "1": {"default_sampling_params": {"max_tokens": 16}}}


@pytest.fixture(scope="module")
def server(qwen3_omni_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3-omni-server") / "server.log"
    proc = ServerProcess.launch([str(qwen3_omni_dir), "--served-model-name", NAME,
                                 "--stage-overrides", json.dumps(in_threads(3, OVERRIDES))], log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def part_text(s: str) -> dict:
    return {"type": "text", "text": s}


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def requests() -> list[dict]:
    """8 requests: messages + audio options, across text, audio+text and image+text."""
    wav = audio_bytes("WAV", seconds=0.6, sr=16000, channels=1)
    png = image_bytes("PNG", size=(64, 48), seed=3)
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png)}}
    contents = [
        "Hello there!",
        [part_text("Tell me about cats.")],
        [audio, part_text("What is this sound?")],
        [part_text("Transcribe:"), audio],
        [image, part_text("Describe the picture.")],
        [image, audio, part_text("Both at once?")],
        [image, part_text("Colours?")],
        "Why is the sky blue?",
    ]
    voices = ["Ethan", "Chelsie"]
    return [{"messages": [{"role": "user", "content": c}], "audio": {"format": "wav", "voice": voices[i % 2]}}
            for i, c in enumerate(contents)]


def wav_samples(b64: str) -> np.ndarray:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="int16")
    assert rate == SR and data.ndim == 1
    return data


def test_health_lists_the_three_stages(server):
    health = server.get("/health").json()
    assert [s["model_stage"] for s in health["stages"]] == ["thinker", "talker", "code2wav"]
    assert [s["state"] for s in health["stages"]] == ["up", "up", "up"]


def test_8_concurrent_requests_equal_their_solo_runs(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model=NAME, modalities=["text", "audio"])
    solo = [client.chat.completions.create(**r, **kw) for r in requests()]

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(aclient.chat.completions.create(**r, **kw) for r in requests()))

    for i, (one, many) in enumerate(zip(solo, asyncio.run(together()), strict=True)):
        assert [c.index for c in many.choices] == [0, 1], i
        assert many.choices[0].message.content == one.choices[0].message.content, i
        assert many.usage.completion_tokens == one.usage.completion_tokens == 8, i
        speech = many.choices[1].message.audio
        assert speech.transcript == many.choices[0].message.content, i
        samples, ref = wav_samples(speech.data), wav_samples(one.choices[1].message.audio.data)
        assert samples.size == ref.size > 0 and np.abs(samples).max() > 0, i
        # code2wav in a padded batch vs alone differs in float rounding (the pipeline test holds
        # it to 1e-4): in 16-bit PCM that is up to 1e-4 * 32768 steps, plus one of quantization.
        assert np.abs(samples.astype(np.int32) - ref).max() <= 1e-4 * 32768 + 1, i


def test_unknown_voice_is_400(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=r"unknown speaker 'Nobody'; available: \['chelsie', 'ethan'\]"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       audio={"format": "wav", "voice": "Nobody"})
