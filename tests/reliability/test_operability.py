"""What an operator reads: one access-log line per request (id, route, status, latency, tokens,
audio, stages), no false warnings on a CPU-only machine, and a clear word on a hub id that
is not on the machine."""
from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys

import soundfile as sf

from tests.pipeline.conftest import wait_until
from tests.reliability.conftest import NAME
from tests.server.conftest import REPO


def _access_lines(server, request_id: str) -> list[str]:
    return [line for line in server.proc.log_path.read_text().splitlines()
            if "vllm_omni.access" in line and f"id={request_id} " in line]


def test_one_access_line_per_request(server):
    speech = server.chat("Log me.").json()
    assert wait_until(lambda: len(_access_lines(server, speech["id"])) == 1, 10.0)
    (line,) = _access_lines(server, speech["id"])
    usage = speech["usage"]
    assert re.search(r'"POST /v1/chat/completions" 200 \d+\.\d{3}s ', line), line
    assert f"tokens_in={usage['prompt_tokens']} tokens_out={usage['completion_tokens']} " in line
    wav, rate = sf.read(io.BytesIO(base64.b64decode(speech["choices"][1]["message"]["audio"]["data"])))
    assert line.endswith(f" audio_s={len(wav) / rate:.2f} stages=thinker,talker,code2wav"), line

    streamed = server.post("/v1/completions", {"model": NAME, "prompt": "Stream me.", "max_tokens": 3,
                                               "stream": True})
    first = next(line for line in streamed.text.splitlines() if line.startswith("data: {"))
    request_id = re.search(r'"id": "([^"]+)"', first).group(1)
    assert wait_until(lambda: len(_access_lines(server, request_id)) == 1, 10.0)
    assert "tokens_out=3 audio_s=0.00 stages=thinker" in _access_lines(server, request_id)[0]

    bad = server.chat(seed=-1, top_p=7)  # refused before it has an id: still one line, with its status
    assert bad.status_code == 400
    assert wait_until(lambda: '"POST /v1/chat/completions" 400 ' in server.proc.log_path.read_text(), 10.0)


def test_no_false_warnings_on_a_cpu_machine(server):
    if os.path.isdir("/proc/driver/nvidia"):
        return  # the device lines are right where there are GPUs
    log = server.proc.log_path.read_text()
    assert "needs 'spawn'" not in log and "CUDA_VISIBLE_DEVICES" not in log


def test_a_hub_id_that_is_not_here_says_how_to_get_it(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", "someorg/some-omni-model",
                           "--port", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "hf download someorg/some-omni-model" in proc.stderr and "Traceback" not in proc.stderr
