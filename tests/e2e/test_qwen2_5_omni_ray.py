"""The Ray worker backend on the tiny Qwen2.5-Omni (thinker -> talker -> code2wav).

- `Omni(worker_backend="ray")` with no Ray running starts a local one: each stage is a Ray
  actor holding one CPU; text tokens, talker codes and waveforms equal the default backend's
  (the same worker loop, run here with its stages as threads); an actor killed with `ray.kill`
  is restarted by the supervisor and serves the same outputs; a second pipeline that does not
  fit fails at once and leaves that Ray to the first; the last close() shuts it down (no Ray
  process left, this process no driver).
- On a Ray that is not ours (initialized by the caller; `vllm-omni serve --ray-address` to
  it) close() and SIGTERM kill only our actors and leave the cluster running; the server's
  speech over HTTP equals the default backend's.
- Without Ray, the backend is a clear start-up error naming the extra; importing vllm_omni
  does not import ray.

Two Ray starts in all (each takes seconds on 2 cores): the one Omni owns, then the caller's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import openai
import pytest
import torch

from tests.conftest import in_threads
from tests.e2e.conftest import TALKER_TOKENS, THINKER_TOKENS, by_request, mixed_prompts, short_params
from tests.pipeline.conftest import pid_alive, wait_until
from tests.server.conftest import REPO, ServerProcess
from tests.server.test_server_omni import pcm16, wav_samples
from vllm_omni import Omni

CLUSTER_CPUS = 4
PROMPTS = [mixed_prompts()[1], mixed_prompts()[4]]  # text with a voice; an image and text
RECOVERY_S = 180.0  # a restarted stage imports torch and loads its model again on a loaded machine


def run(omni, prompts: list = PROMPTS) -> list[dict]:
    """Per prompt: the thinker's tokens, the talker's codes and the waveform."""
    outs = by_request(omni.generate(prompts, short_params(), use_tqdm=False))
    assert all(o.error is None for req in outs for o in req.values())
    return [{"tokens": req["text"].request_output.outputs[0].token_ids, "text": req["text"].request_output.outputs[0].text,
             "codes": req["audio"].request_output.prompt_token_ids,
             "audio": req["audio"].request_output.outputs[0].multimodal_output["audio"]} for req in outs]


def assert_same(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref) == len(PROMPTS)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a["tokens"] == b["tokens"] and a["codes"] == b["codes"], i
        assert a["audio"].numel() > 0 and torch.equal(a["audio"], b["audio"]), i


def our_actors(ray) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("vllm-omni-")]


def is_ray_actor(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().startswith(b"ray::StageActor")


@pytest.fixture(scope="module")
def reference(omni_dir) -> list[dict]:
    """The default backend on the bundled config, one request at a time, its stages as threads of
    this process: the stage processes' worker loop, with their outputs to the last bit
    (tests/server/test_server_omni.py compares the two exactly), without importing torch three
    more times in this interpreter."""
    with Omni(model=str(omni_dir), stage_overrides=in_threads(3)) as omni:
        return [out for prompt in PROMPTS for out in run(omni, [prompt])]


# ------------------------------------------- a Ray of our own: Omni starts it and shuts it down


@pytest.fixture(scope="module")
def ray_omni(omni_dir, reference):
    import ray

    assert not ray.is_initialized()
    omni = Omni(model=str(omni_dir), worker_backend="ray")  # no address, no RAY_ADDRESS: a local Ray
    yield omni
    omni.close()


def test_stages_run_as_ray_actors_with_the_same_outputs(ray_omni, reference):
    import ray

    pids = [h.pid for h in ray_omni.stage_health()]
    assert all(is_ray_actor(p) for p in pids), pids
    names = our_actors(ray)  # "vllm-omni-<pid>-<tag>-stage<id>-<launch>"
    assert sorted(n.split("-")[-2:] for n in names) == [["stage0", "1"], ["stage1", "1"], ["stage2", "1"]]
    # The local Ray has a logical CPU per stage even on 2 cores, and each actor holds one.
    assert ray.cluster_resources()["CPU"] == max(3, os.cpu_count())
    assert wait_until(lambda: ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"] - 3, 10.0)
    assert_same(run(ray_omni), reference)


def test_killed_actor_is_restarted_and_serves_the_same(ray_omni, reference):
    import ray

    old = {h.stage_id: h.pid for h in ray_omni.stage_health()}
    [talker] = [n for n in our_actors(ray) if "-stage1-" in n]
    ray.kill(ray.get_actor(talker, namespace=_namespace_of(ray, talker)))
    assert wait_until(lambda: ray_omni.stage_health()[1].state.value != "up", 30.0)
    assert wait_until(lambda: all(h.state.value == "up" for h in ray_omni.stage_health()), RECOVERY_S)
    new = {h.stage_id: h.pid for h in ray_omni.stage_health()}
    assert new[1] != old[1] and is_ray_actor(new[1]) and {new[0], new[2]} == {old[0], old[2]}
    assert wait_until(lambda: not pid_alive(old[1]), 10.0)
    assert talker not in our_actors(ray) and len(our_actors(ray)) == 3
    assert_same(run(ray_omni), reference)


def test_a_full_local_ray_fails_fast_and_the_last_close_shuts_it_down(ray_omni, omni_dir, reference):
    import ray

    # Our local Ray has a CPU per stage of the first pipeline: a second pipeline of this process
    # cannot be placed, and says so at once instead of waiting out stage_init_timeout; its
    # failed start leaves the Ray of the first running.
    with pytest.raises(RuntimeError, match="the local Ray instance this process started has too few free"):
        Omni(model=str(omni_dir), output_modalities=["text"], worker_backend="ray")
    assert ray.is_initialized()
    assert_same(run(ray_omni), reference)
    ray_processes = {p for p in descendants(os.getpid()) if b"ray" in _cmd(p)}  # gcs, raylet, actors, ...
    assert any(b"raylet" in _cmd(p) for p in ray_processes)
    ray_omni.close()
    assert not ray.is_initialized()  # this process is no Ray driver any more
    assert wait_until(lambda: not any(pid_alive(p) for p in ray_processes), 30.0), \
        [_cmd(p) for p in ray_processes if pid_alive(p)]


def _namespace_of(ray, name: str) -> str:
    return next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _cmd(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


# ----------------------------------- an existing cluster: only our actors go, the cluster stays


@pytest.fixture(scope="module")
def ray_cluster(ray_omni):
    """A cluster that is not ours: started here, after the Omni that owned its own Ray closed."""
    import ray

    ray_omni.close()
    context = ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False)
    yield ray, context.address_info["gcs_address"]
    ray.shutdown()


def test_omni_on_the_callers_ray_kills_only_its_actors(ray_cluster, omni_dir, reference):
    ray, _ = ray_cluster
    with Omni(model=str(omni_dir), output_modalities=["text"], worker_backend="ray") as omni:  # the thinker alone
        [pid] = [h.pid for h in omni.stage_health()]
        assert is_ray_actor(pid) and len(our_actors(ray)) == 1
        outs = omni.generate(PROMPTS, [{"max_tokens": THINKER_TOKENS}], use_tqdm=False)
        assert [o.request_output.outputs[0].token_ids for o in outs] == [r["tokens"] for r in reference]
    assert ray.is_initialized()  # the caller's Ray stays up, without our actor
    assert wait_until(lambda: not our_actors(ray) and not pid_alive(pid), 10.0)
    assert wait_until(lambda: ray.available_resources().get("CPU") == CLUSTER_CPUS, 10.0)


def test_server_with_ray_address_then_only_its_actors_go(ray_cluster, omni_dir, reference, tmp_path):
    ray, address = ray_cluster
    talker = json.dumps({"1": {"default_sampling_params": {"max_tokens": TALKER_TOKENS}}})
    server = ServerProcess.launch([str(omni_dir), "--served-model-name", "tiny", "--worker-backend", "ray",
                                   "--ray-address", address, "--stage-overrides", talker], tmp_path / "server.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        prompt = PROMPTS[0]
        resp = client.chat.completions.create(model="tiny", messages=prompt["messages"], max_tokens=THINKER_TOKENS,
                                              modalities=["text", "audio"],
                                              audio={"voice": prompt["speaker"], "format": "wav"})
        assert all(is_ray_actor(p) for p in server.stage_pids) and len(our_actors(ray)) == 3
        server.proc.send_signal(signal.SIGTERM)  # the server alone, not its group: it stops its actors
        server.proc.wait(60)
    finally:
        server.stop()  # a no-op unless the checks above failed
    assert wait_until(lambda: not our_actors(ray), 10.0), our_actors(ray)
    assert wait_until(lambda: not any(pid_alive(p) for p in server.stage_pids), 10.0)
    assert ray.is_initialized() and wait_until(lambda: ray.available_resources().get("CPU") == CLUSTER_CPUS, 10.0)
    assert resp.choices[0].message.content == reference[0]["text"]
    assert np.array_equal(wav_samples(resp.choices[1].message.audio.data), pcm16(reference[0]["audio"].numpy()))


# ------------------------------------------------------------------------------ without Ray


def test_without_ray_the_backend_is_a_clear_error_and_nothing_imports_ray(monkeypatch, omni_dir):
    from vllm_omni.engine.orchestrator import RuntimeOptions

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when it is not installed
    with pytest.raises(ValueError, match=r'needs Ray, an optional extra: pip install "vllm-omni\[ray\]"'):
        RuntimeOptions(worker_backend="ray")
    with pytest.raises(ValueError, match=r"--ray-address\) needs --worker-backend ray"):
        RuntimeOptions(ray_address="auto")
    code = ("import sys; sys.modules['ray'] = None\n"
            "import vllm_omni, vllm_omni.engine.runtime, vllm_omni.engine.ray_cluster, vllm_omni.engine.ray_launcher\n"
            "from vllm_omni import Omni, AsyncOmni\n"
            "from vllm_omni.entrypoints.cli.main import main\n"
            f"sys.exit(main(['serve', {str(omni_dir)!r}, '--worker-backend', 'ray']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert 'error: --worker-backend ray needs Ray, an optional extra: pip install "vllm-omni[ray]"' in proc.stderr


def test_unreachable_ray_address_fails_the_start_fast(omni_dir, tmp_path):
    from tests.server.conftest import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    server = ServerProcess.launch([str(omni_dir), "--worker-backend", "ray", "--ray-address", address],
                                  tmp_path / "server.log")
    try:
        assert server.proc.wait(60) == 1  # ray.init alone would retry for minutes
    finally:
        server.stop()
    assert f"the pipeline failed to start: cannot reach the Ray cluster at {address}" in server.log_tail()


def test_actor_resources_follow_devices_and_tensor_parallel(omni_dir):
    from vllm_omni.engine.ray_cluster import actor_resources
    from vllm_omni.entrypoints.omni_base import load_pipeline

    def gpus(overrides=None, on_gpu=True) -> list[float]:
        pipeline = load_pipeline(str(omni_dir), None, None, overrides, {})
        res = [actor_resources(s, pipeline, on_gpu) for s in pipeline.stages]
        assert all(r["num_cpus"] == 1 for r in res)
        return [r["num_gpus"] for r in res]

    assert gpus() == [0.5, 1.0, 0.5]  # the bundled config: thinker and code2wav share GPU 0
    assert gpus(on_gpu=False) == [0, 0, 0]
    tp = {"0": {"devices": "0,1", "tensor_parallel_size": 2}, "1": {"devices": "2"}, "2": {"devices": "2"}}
    assert gpus(tp) == [2.0, 0.5, 0.5]
    assert gpus({"0": {"devices": "1"}, "1": {"devices": "1"}, "2": {"devices": "1"}}) == [0.3333] * 3
