"""What every test folder shares, and why.

- One torch thread per process (OMP_NUM_THREADS=1, below), inherited by every child process.
- `tiny_model(arch, seed=0, **overrides)`: each tiny random checkpoint is built once per
  session (a folder under pytest's tmp dir) and reused by every test that asks for it;
  `omni_dir` and `qwen3_omni_dir` are the two omni families' default ones.
- `write_yaml(text, name)`: a dedented YAML file in the test's tmp_path.
- `in_threads(n_stages, overrides)`: stage overrides that run a pipeline's stages as threads of
  the process that starts them (`runtime.process: false`, the product's own in-process mode:
  the same worker loop, sockets and messages as a stage process). A 3-stage `Omni` then starts
  in about a second instead of spawning three processes that each import torch (~10 s of CPU);
  a server started with `--stage-overrides` of them is one process. Use it wherever the test
  is not about processes; keep real stage processes for supervision, shutdown, kills, death
  signals, headless stages, replicas and Ray, and for one end-to-end test per model family.
- `demo_server`: one `vllm serve --omni` of the embedded demo model for the session, shared by
  every test that only needs the demo served (tests/realtime, tests/server/test_server_demo.py).

Folder conftests share servers and pipelines the same way (see their docstrings): start one per
module or session, never one per test, and reuse it when a new test only needs what it serves.

The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup`, the README's command): a
module runs whole on one worker, and so do all modules that share a server or pipeline started
for a package or the session (`SHARED_ACROSS_MODULES`, grouped by `pytest_collection_modifyitems`
below), so each is started once, as in a serial run.
"""
import os
import textwrap

# Nothing can be downloaded: make any accidental hub lookup fail fast.
os.environ["HF_HUB_OFFLINE"] = "1"
# One torch (OpenMP) thread in this process and in every process it starts (servers, stages),
# set before torch is imported. The tiny models' ops are too small to gain from a second
# thread, while threads of several busy processes spin-wait against each other on CI's 2 cores:
# tests/core/test_llm_config_sweep.py took 69-81 s with 6 s of CPU at 1 thread, 249-267 s with
# 25 s of CPU at 2 (a loaded 2-core machine). It also gives stages in threads and in processes
# the same float rounding, so their outputs compare exactly. An explicit setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The demo server's realtime caps, which tests/realtime reaches on purpose.
DEMO_MAX_INPUT_AUDIO_S = 10
DEMO_MAX_HISTORY_AUDIO_S = 25


# Package- or session-scoped fixtures that start processes (servers, pipelines): the modules using
# one run on the same xdist worker. A new such fixture belongs here.
SHARED_ACROSS_MODULES = frozenset({"demo_server", "server", "omni25", "omni3", "headless_cluster",
                                   "voices_server"})


@pytest.hookimpl(wrapper=True)  # a wrapper runs before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Give every test an xdist group (`--dist loadgroup` sends a group whole to one worker, and
    schedules ungrouped tests one by one): its module, merged (union-find) with every other
    module that uses the same shared fixture."""
    if not hasattr(config, "workerinput"):  # not an xdist worker (a serial run, or xdist not installed)
        return (yield)
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key] = parent[parent[key]]
        return key

    modules = [item.nodeid.split("::", 1)[0] for item in items]
    for item, module in zip(items, modules):
        for name in item.fixturenames:
            defs = item._fixtureinfo.name2fixturedefs.get(name)
            if name in SHARED_ACROSS_MODULES and defs and defs[-1].scope in ("package", "session"):
                parent[root(module)] = root(f"{defs[-1].baseid}::{name}")
    for item, module in zip(items, modules):
        item.add_marker(pytest.mark.xdist_group(root(module)))
    return (yield)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(arch, seed=0, **overrides) -> Path`, built once per distinct call.

    The folder is shared by every test in the session: copy it before changing files in it.
    """
    from vllm_omni.testing.tiny_models import make_tiny_model

    built: dict[tuple, Path] = {}

    def build(arch: str, seed: int = 0, **overrides) -> Path:
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-s{seed}")
            built[key] = make_tiny_model(arch, out, seed=seed, **overrides)
        return built[key]

    return build


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`vllm serve --omni` with no MODEL (the upstream spelling): the server builds the embedded
    demo model in a fresh cache, as on a new user's machine, and runs it with real stage
    processes, with the demo's own settings (short replies: vllm_omni/testing/demo_model.py), which
    tests/server/test_server_demo.py checks as a new user meets them. Started at its first use,
    stopped (stages checked gone) at the end of the session."""
    from tests.server.conftest import ServerProcess

    tmp = tmp_path_factory.mktemp("demo-server")
    srv = ServerProcess.launch(["--omni", "--realtime-max-input-audio-s", str(DEMO_MAX_INPUT_AUDIO_S),
                                "--realtime-max-history-audio-s", str(DEMO_MAX_HISTORY_AUDIO_S)],
                               tmp / "server.log", env={"VLLM_OMNI_CACHE": str(tmp / "cache")}, entry="vllm")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def omni_dir(tiny_model) -> Path:
    return tiny_model("qwen2_5_omni")


@pytest.fixture(scope="session")
def qwen3_omni_dir(tiny_model) -> Path:
    return tiny_model("qwen3_omni_moe")


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text, name="stages.yaml") -> Path of a dedented YAML file in tmp_path."""
    def write(text: str, name: str = "stages.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path
    return write


def in_threads(n_stages: int, overrides: dict | None = None) -> dict:
    """`overrides` (stage id -> fields, as `stage_overrides` / `--stage-overrides` take them) with
    stages 0..n_stages-1 run as threads (`process: false`); other fields are kept."""
    merged = {str(k): dict(v) for k, v in (overrides or {}).items()}
    for stage in range(n_stages):
        merged.setdefault(str(stage), {})["process"] = False
    return merged
