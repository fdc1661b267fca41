"""Admission by playback load through a real `vllm-omni serve` (tiny Qwen3-TTS): with
`--admission-policy reject`, a request that would push the streams playing past the playback
load gets an OpenAI-shaped 429 with Retry-After while a stream plays; once nothing plays it is
served again. The headroom is set so high (limit 0.01 GPU-seconds per second) that any stream
measured is "the load"."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import in_threads
from tests.server.conftest import ServerProcess

FRAMES = 60  # ~5 s of speech: the first stream still plays while the second request comes
# Both stages run as threads of the server: admission is the server's, not the stage processes'.
OVERRIDES = json.dumps(in_threads(2, {"0": {"max_num_seqs": 4, "default_sampling_params": {"max_tokens": FRAMES,
                                                                                           "min_tokens": FRAMES}},
                                      "1": {"max_num_seqs": 4}}))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("admission-server") / "server.log"
    proc = ServerProcess.launch([str(tiny_model("qwen3_tts", task_type="CustomVoice")), "--stage-overrides", OVERRIDES,
                                 "--served-model-name", "tts", "--admission-policy", "reject",
                                 "--admission-headroom", "0.99"], log).wait_ready()
    yield proc
    proc.stop()


def body(**extra) -> dict:
    return {"model": "tts", "input": "Hello there, how are you today?", "voice": "vivian", "response_format": "pcm",
            **extra}


def test_a_request_past_the_playback_load_is_refused_with_429_while_a_stream_plays(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/audio/speech", json=body(stream_format="audio")) as playing:
            assert playing.status_code == 200
            pieces = playing.iter_bytes()
            for _ in range(3):  # a few chunks out: the orchestrator has measured the stream
                next(pieces)
            refused = client.post("/v1/audio/speech", json=body())
            rest = b"".join(pieces)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and "playback load" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert rest  # the stream that played went on to its end
        assert client.post("/v1/audio/speech", json=body()).status_code == 200  # nothing plays: served
