"""One real headless cluster on loopback for the package's process tests: the head (`vllm-omni
serve MODEL --stage-id 0 -oma A -omp P`, with the API server) and stages 1 and 2 as
`vllm-omni serve MODEL --headless --stage-id N` processes, all with the cluster secret
(`--omni-secret-file`), on the tiny Qwen2.5-Omni pipeline; a real HTTP client against the head.

Stage 2 starts before the head and stage 1 after it (with its own engine flags); a headless
command with another secret (the impostor) starts with them. A cluster is six processes that each
import torch, so `headless_cluster` starts one for both modules that use it:
test_secure_cluster.py needs it as started (one replica per stage) and leaves it so;
test_stage_cli.py then adds, kills and restarts replicas and ends it with Ctrl-C. A module that
asks for it as started (`get(pristine=True)`) after another changed or stopped it gets a new one,
so either module also runs alone, or in any order.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.conftest import REPO, ServerProcess, free_port

NAME = "tiny-omni"
OVERRIDES = {"0": {"default_sampling_params": {"max_tokens": 8}},
             "1": {"default_sampling_params": {"max_tokens": 24}, "max_num_seqs": 4}}
SPEECH = {"model": NAME, "messages": [{"role": "user", "content": "Say it again."}], "audio": {"voice": "Ethan"}}
TEXT = {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}], "modalities": ["text"]}
HEARTBEAT_TIMEOUT_S = 3.0  # the default, given as the flag (issue 41: a stopped stage is reported within 5 s)
READY_S = 240.0  # 2 busy CPU cores, several processes importing torch at once
SECRET = "a-cluster-secret-for-the-tests-" + "9" * 12
WRONG_SECRET = "not-the-cluster-secret-at-all-" + "1" * 12


class Headless:
    """One `vllm-omni serve MODEL --headless --stage-id N` process."""

    def __init__(self, model: Path, stage_id: int, master_port: int, log: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(model), "--headless",
               "--stage-id", str(stage_id), "--omni-master-address", "127.0.0.1", "--omni-master-port",
               str(master_port), "--stage-overrides", json.dumps(OVERRIDES), *extra]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def head_args(model: Path, master_port: int, *extra: str) -> list[str]:
    return [str(model), "--served-model-name", NAME, "--stage-overrides", json.dumps(OVERRIDES),
            "--omni-master-address", "127.0.0.1", "--omni-master-port", str(master_port), *extra]


def stage(server: ServerProcess, stage_id: int) -> dict:
    return server.get("/health").json()["stages"][stage_id]


def answer(server: ServerProcess, body: dict) -> tuple:
    r = server.post("/v1/chat/completions", body, timeout=120.0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    return tuple(c["message"]["content"] if c["message"].get("audio") is None else c["message"]["audio"]["data"]
                 for c in choices)


class Cluster:
    """The head, the headless commands (`headless`, in start order) and the impostor."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.master_port = free_port()
        self.secret_file = tmp / "secret"
        self.secret_file.write_text(SECRET)
        self.secret_file.chmod(0o600)
        self.secret = ("--omni-secret-file", str(self.secret_file))
        self.headless: list[Headless] = []
        self.head: ServerProcess | None = None
        self.impostor: Headless | None = None  # a headless command with another secret
        self.impostor_started = 0.0
        self.changed = False  # replicas added, killed or stopped for good by a test

    def start_headless(self, stage_id: int, *extra: str) -> Headless:
        """A headless command with the cluster secret."""
        h = Headless(self.model, stage_id, self.master_port, self.tmp / f"headless{len(self.headless)}.log",
                     *self.secret, *extra)
        self.headless.append(h)
        return h

    def start(self) -> Cluster:
        self.start_headless(2)  # before the head: it keeps trying to register
        time.sleep(1.0)
        self.head = ServerProcess.launch(head_args(self.model, self.master_port, "--stage-id", "0", *self.secret,
                                                   "--max-model-len", "1024", "--omni-lb-policy", "round-robin",
                                                   "--omni-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
                                         self.tmp / "head.log")
        self.start_headless(1, "--max-model-len", "512")  # after the head; its own engine flags
        # Started with the others, so that its start-up overlaps theirs: the secret it has is not the head's.
        self.impostor = Headless(self.model, 1, self.master_port, self.tmp / "impostor.log", "--stage-init-timeout",
                                 "900", env={"VLLM_OMNI_SECRET": WRONG_SECRET})
        self.impostor_started = time.monotonic()
        self.head.wait_ready(READY_S)
        return self

    def stop(self) -> None:
        try:
            if self.head is not None:
                self.head.stop()
        finally:
            for h in [*self.headless, self.impostor]:
                if h is not None:
                    h.kill()


class SharedCluster:
    def __init__(self, model: Path, tmp_path_factory) -> None:
        self.model, self.tmp_path_factory = model, tmp_path_factory
        self.current: Cluster | None = None

    def get(self, pristine: bool) -> Cluster:
        """The running cluster; a new one if there is none, its head has exited, or `pristine` and
        a test changed it."""
        c = self.current
        if c is None or c.head is None or c.head.proc.poll() is not None or (pristine and c.changed):
            self.current = None
            if c is not None:
                c.stop()
            c = Cluster(self.model, self.tmp_path_factory.mktemp("headless-cluster"))
            try:
                self.current = c.start()
            except BaseException:
                c.stop()
                raise
        return c


@pytest.fixture(scope="package")
def headless_cluster(omni_dir, tmp_path_factory):
    shared = SharedCluster(omni_dir, tmp_path_factory)
    try:
        yield shared
    finally:
        if shared.current is not None:
            shared.current.stop()
