"""One real `vllm-omni serve` for the whole reliability package, and what its tests share.

The server runs the tiny Qwen2.5-Omni (the demo model's pipeline: thinker -> talker ->
token2wav) with short outputs, small limits that the tests hit on purpose, and the
fault-injecting thinker2talker bridge of faults.py (a no-op for ordinary requests). Tests that
kill a stage leave it restarted and serving; the SIGTERM test starts a server of its own
(`launch`); the shared one is stopped with SIGINT (Ctrl-C) and checked to leave nothing behind.
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.pipeline.conftest import wait_until
from tests.reliability.faults import THINKER2TALKER, add_fault_voices
from tests.server.conftest import ServerProcess

NAME = "tiny-omni"
THINKER_TOKENS, TALKER_TOKENS = 8, 24
OVERRIDES = {"0": {"default_sampling_params": {"max_tokens": THINKER_TOKENS}, "max_tokens_limit": 64},
             "1": {"default_sampling_params": {"max_tokens": TALKER_TOKENS}, "max_tokens_limit": TALKER_TOKENS,
                   "max_num_seqs": 4,
                   "custom_process_input_func": THINKER2TALKER}}
MAX_REQUEST_BYTES = 2 * 1024 * 1024
MAX_PROMPTS = 8
MAX_CONCURRENT = 40


@dataclass
class Server:
    proc: ServerProcess

    @property
    def url(self) -> str:
        return self.proc.url

    def post(self, path: str, body: object, **kw) -> httpx.Response:
        """A raw POST of a JSON value, bytes or an iterator of chunks (any bytes, not only what
        the openai client would send)."""
        content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=kw.pop("timeout", 60.0), **kw)

    def chat(self, text: str = "Hello!", **body) -> httpx.Response:
        return self.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": text}],
                                                  **body})

    def running(self) -> float | None:
        return self.proc.metric("vllm_omni:num_requests_running")

    def assert_serving(self) -> None:
        """Nothing holds an admission slot, and a plain request still gets text and speech."""
        assert wait_until(lambda: self.running() == 0.0, 10.0), self.running()
        r = self.chat("Are you still there?")
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def launch(tmp: Path, model: Path, *extra: str, overrides: dict | None = None) -> ServerProcess:
    return ServerProcess.launch(
        [str(model), "--served-model-name", NAME, "--stage-overrides", json.dumps(overrides or OVERRIDES), *extra],
        tmp / "server.log")


@pytest.fixture(scope="session")
def fault_model(tiny_model, tmp_path_factory) -> Path:
    return add_fault_voices(tiny_model("qwen2_5_omni"), tmp_path_factory.mktemp("fault-model") / "model")


@pytest.fixture(scope="package")
def server(fault_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability-server")
    proc = launch(tmp, fault_model, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                  "--max-prompts-per-request", str(MAX_PROMPTS),
                  "--max-concurrent-requests", str(MAX_CONCURRENT))
    try:
        yield Server(proc.wait_ready())
    finally:
        stop_cleanly(proc)


def stop_cleanly(proc: ServerProcess) -> None:
    """Ctrl-C (SIGINT) the server and check it left nothing: it exits 0 without a traceback,
    and no stage process (restarted ones included), shared memory or IPC folder remains."""
    pid = proc.proc.pid
    before = len(proc.log_path.read_bytes())
    if proc.proc.poll() is None:
        try:
            proc.stage_pids += [s["pid"] for s in proc.get("/health", timeout=5.0).json()["stages"]]
        except httpx.HTTPError:
            pass  # not answering any more: the pids it started with are still checked
        proc.proc.send_signal(signal.SIGINT)
        try:
            code = proc.proc.wait(60)
        finally:
            proc.stop()
        assert code == 0, proc.log_tail()
    proc.stop()
    assert b"Traceback" not in proc.log_path.read_bytes()[before:], proc.log_tail()  # while shutting down
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"vomni-{pid}-")]
    assert not [n for n in os.listdir("/tmp") if n.startswith(f"vomni-{pid}-")]
