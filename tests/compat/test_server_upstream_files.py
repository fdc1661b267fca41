"""Upstream's own files served as written, on tiny checkpoints, driven by upstream's request
shapes and clients: its Qwen3-TTS deploy file (subtalker settings, connector extras, streaming
into code2wav) with its speech client's request and `vllm bench serve` on the speech backend,
and its Qwen3-Omni async-chunk stage config (chunk options on the thinker -> talker connector)
with its curl example's body, thinker max_tokens 16384 included (the context bounds it).
The stages run as threads of the server (--stage-overrides process: false): what is checked
here is the files and requests, not stage processes."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from tests.compat.test_upstream_files import UPSTREAM
from tests.conftest import in_threads
from tests.server.conftest import ServerProcess

TTS_NAME = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"  # what upstream's client asks for
OMNI_NAME = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
THINKER_CONTEXT = 224  # the tiny tokenizer makes ~170 tokens of upstream's system prompt
SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory "
          "and visual inputs, as well as generating text and speech.")


@pytest.fixture(scope="module")
def tts_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("upstream-tts") / "server.log"
    proc = ServerProcess.launch([str(tiny_model("qwen3_tts", task_type="CustomVoice")), "--omni",
                                 "--deploy-config", str(UPSTREAM / "vllm_omni/deploy/qwen3_tts.yaml"),
                                 "--served-model-name", TTS_NAME,
                                 "--stage-overrides",
                                 json.dumps(in_threads(2, {"0": {"default_sampling_params": {"max_tokens": 16}}}))],
                                log, entry="vllm")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_upstream_tts_deploy_file_serves_its_speech_client(tts_server):
    """examples/online_serving/qwen3_tts/openai_speech_client.py's request, as it sends it."""
    log = tts_server.log_path.read_text()
    assert "connector_get_sleep_s: stages here are event driven" in log
    payload = {"model": TTS_NAME, "input": "Hello, how are you?", "voice": "Vivian", "response_format": "wav",
               "task_type": "CustomVoice", "language": "English"}
    r = httpx.post(f"{tts_server.url}/v1/audio/speech", json=payload, timeout=120,
                   headers={"Authorization": "Bearer EMPTY"})
    assert r.status_code == 200, r.text
    audio, rate = sf.read(io.BytesIO(r.content))
    assert rate == 24000 and audio.size > 0


def test_vllm_bench_serve_on_the_speech_backend(tts_server, tmp_path):
    vllm = Path(sys.executable).with_name("vllm")
    out = subprocess.run([str(vllm), "bench", "serve", "--omni", "--backend", "openai-audio-speech", "--base-url",
                          tts_server.url, "--model", TTS_NAME, "--num-prompts", "2", "--random-input-len", "4",
                          "--extra-body", '{"voice": "vivian"}', "--save-result", "--result-dir", str(tmp_path),
                          "--result-filename", "tts.json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    saved = json.loads((tmp_path / "tts.json").read_text())
    assert saved["completed"] == 2 and saved["audio_seconds"] > 0 and "audio_ttfp" in saved["metrics"]
    assert "Time to First Packet" in out.stdout and "Playback underruns:" in out.stdout


@pytest.fixture(scope="module")
def omni_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("upstream-omni") / "server.log"
    # Short contexts so that upstream's max_tokens run to them fast on a CPU.
    overrides = in_threads(3, {"0": {"max_model_len": THINKER_CONTEXT}, "1": {"max_model_len": 640}})
    proc = ServerProcess.launch([str(tiny_model("qwen3_omni_moe")), "--omni", "--stage-configs-path",
                                 str(UPSTREAM / "vllm_omni/model_executor/stage_configs/qwen3_omni_moe_async_chunk.yaml"),
                                 "--served-model-name", OMNI_NAME, "--stage-overrides", json.dumps(overrides)],
                                log, entry="vllm")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_upstream_curl_body_with_its_max_tokens_runs_to_the_context(omni_server):
    """run_curl_multimodal_generation.sh text: sampling_params_list with the thinker's 16384."""
    body = {"model": OMNI_NAME, "modalities": None, "mm_processor_kwargs": {}, "sampling_params_list": [
        {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "seed": 42, "repetition_penalty": 1.05,
         "stop_token_ids": [151645]},
        {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
         "repetition_penalty": 1.05, "stop_token_ids": [2150]},
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
         "repetition_penalty": 1.1}],
        "messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                     {"role": "user", "content": [{"type": "text", "text": "Explain the system architecture for a "
                                                   "scalable audio generation pipeline. Answer in 15 words."}]}]}
    r = omni_server.post("/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    text = [c for c in out["choices"] if c["message"].get("content")]
    audio = [c for c in out["choices"] if c["message"].get("audio")]
    assert len(text) == 1 and len(audio) == 1
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= THINKER_CONTEXT
