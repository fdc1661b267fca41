"""A real `vllm-omni serve` subprocess per test module, and what the tests share (one server,
`voices_server`, is shared by two modules).

Each server runs in its own process group (start_new_session) and is stopped in teardown with
SIGTERM, then SIGKILL; its stage processes (own groups, parent-death signal) must be gone too,
so no server or stage outlives a test module.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.pipeline.conftest import pid_alive, wait_until

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0  # 2 CPU cores, several stages importing torch at once
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    stage_pids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def launch(cls, args: list[str], log_path: Path, env: dict[str, str] | None = None,
               entry: str = "vllm-omni") -> ServerProcess:
        port = free_port()
        if entry == "vllm":  # the `vllm serve ... --omni` console script's function
            cmd = [sys.executable, "-c", "import sys; from vllm_omni.entrypoints.cli.serve import vllm_main; "
                   "sys.exit(vllm_main())", "serve"]
        else:
            cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve"]
        cmd += [*args, "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
        log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it until it exits
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        log.close()
        return cls(proc, port, log_path)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2.0)
                if r.status_code == 200:
                    self.stage_pids = [s["pid"] for s in r.json()["stages"]]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM the server's group, SIGKILL after a deadline; then check the stages are gone."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5.0)
        _signal_group(self.proc.pid, signal.SIGKILL)  # anything left in the group
        leftovers = [p for p in self.stage_pids if p and not wait_until(lambda p=p: not pid_alive(p), 10.0)]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"stage processes {leftovers} outlived the server"

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=kw.pop("timeout", 30.0), **kw)

    def post(self, path: str, json: dict, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=json, timeout=kw.pop("timeout", 60.0), **kw)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample's value from /metrics (parsed with prometheus_client's parser)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="package")
def voices_server(tiny_model, tmp_path_factory):
    """The TTS server of test_voices_and_stream.py and test_voices_upstream.py (voices_server.py),
    started once for both: {"server", "ckpt", "tmp"}. A voice written to its folder before it
    starts (`dora`, by the store in this process) and one of another checkpoint (`elsewhere`).
    Each module leaves the stored voices as it found them."""
    from tests.server.voices_server import earlier_voice, foreign_voice, launch

    tmp = tmp_path_factory.mktemp("voices-server")
    foreign_voice(tmp / "voices")
    ckpt = tiny_model("qwen3_tts", task_type="Base")
    earlier_voice(ckpt, tmp / "voices")
    state = {"server": launch(ckpt, tmp / "voices", tmp / "server.log"), "ckpt": ckpt, "tmp": tmp}
    yield state
    state["server"].stop()
