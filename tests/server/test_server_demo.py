"""`vllm serve --omni` with no MODEL: the embedded tiny demo model answers with text and speech."""
from __future__ import annotations

import base64
import io

import openai
import soundfile as sf

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
