"""Upstream's newer format served as written: `vllm-omni serve MODEL --deploy-config` with our
copy of a 2026 deploy YAML (nested stage sections, ignored engine args, an NPU section only an
NPU would read) on the tiny Qwen2.5-Omni checkpoint (its stages as threads of the server);
OpenAI's streaming shape by default.
"""
from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import soundfile as sf

from tests.compat.test_config_compat import DEPLOY
from tests.conftest import in_threads
from tests.server.conftest import ServerProcess

NAME = "Qwen/Qwen2.5-Omni-7B"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("compat-qwen2_5-deploy") / "server.log"
    proc = ServerProcess.launch([str(tiny_model("qwen2_5_omni")), "--served-model-name", NAME,
                                 "--deploy-config", str(DEPLOY), "--enable-log-requests",
                                 "--stage-overrides", json.dumps(in_threads(3))], log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=180)


def test_deploy_config_serves_text_and_speech(client, server):
    assert "mm_processor_cache_gb (stage 0): there is no multimodal processor cache" in server.log_path.read_text()
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello there"}])
    text, speech = out.choices
    assert text.message.content and out.usage.completion_tokens == 8  # the deploy file's max_tokens
    samples, rate = sf.read(io.BytesIO(base64.b64decode(speech.message.audio.data)))
    assert rate == 24000 and samples.size > 0 and speech.message.audio.transcript == text.message.content


def test_openai_streaming_shape_is_the_default(client):
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], stream=True)
    chunks = list(stream)
    audio = [c for c in chunks if c.model_extra.get("modality") == "audio"]
    data = [c.choices[0].delta.audio.data for c in audio if c.choices[0].delta.audio]  # OpenAI's delta.audio
    assert data and all(base64.b64decode(d) for d in data)
    assert all(not c.choices[0].delta.content for c in audio)
