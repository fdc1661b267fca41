"""Tests for vllm_omni.engine.stage_init_utils (spec 002 helpers).

Process-level behaviour (locks, death signal, termination) runs in real child
processes; everything else on plain objects shaped like the stage configs.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from vllm_omni.engine import stage_init_utils as siu

REPO_ROOT = Path(__file__).resolve().parents[2]


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _popen(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env(**env),
    )


def _stage(stage_id=0, *, runtime=None, stage_type="llm", **engine_args):
    return SimpleNamespace(stage_id=stage_id, stage_type=stage_type, runtime=runtime or SimpleNamespace(),
                           engine_args=dict(engine_args))


# --------------------------------------------------------------------------- dataclasses


def _fields(cls) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_plan_dataclasses_have_documented_fields_and_defaults():
    missing = dataclasses.MISSING
    assert _fields(siu.LogicalStageInitPlan) == {"stage_idx": missing, "configured_stage_id": missing,
                                                 "replicas": missing}
    replica = _fields(siu.ReplicaInitPlan)
    assert set(replica) == {"replica_id", "num_replicas", "launch_mode", "metadata", "stage_cfg",
                            "stage_connector_spec", "omni_kv_connector", "stage_vllm_config", "executor_class"}
    assert replica["stage_vllm_config"] is None and replica["executor_class"] is None
    meta = _fields(siu.StageMetadata)
    assert set(meta) == {"stage_id", "stage_type", "engine_output_type", "is_comprehension",
                         "requires_multimodal_data", "engine_input_source", "final_output", "final_output_type",
                         "default_sampling_params", "custom_process_input_func", "model_stage", "runtime_cfg",
                         "prompt_expand_func", "cfg_kv_collect_func", "replica_id"}
    assert (meta["prompt_expand_func"], meta["cfg_kv_collect_func"], meta["replica_id"]) == (None, None, 0)
    ctx = _fields(siu.StageRemoteFactoryContext)
    assert set(ctx) == {"stage_id", "stage_type", "stage_cfg", "base_metadata", "vllm_config", "executor_class",
                        "diffusion_batch_size"}
    assert (ctx["vllm_config"], ctx["executor_class"], ctx["diffusion_batch_size"]) == (None, None, 1)


# --------------------------------------------------------------------------- split_devices_for_replicas


@pytest.mark.parametrize(
    "args, expected",
    [
        # The spec's worked examples.
        (("1,2,3,4", 2, 2, 1), ["1,2", "3,4"]),
        (("0,1", 2, 2, 1), ["0,1", "2,3"]),
        (("0,1", 4, 2, 1), ["0,1", "2,3", "4,5", "6,7"]),
        # One replica: returned unchanged, whatever the string looks like.
        (("3, 5", 1, 2, 0), ["3, 5"]),
        ((None, 1, 1, 0), [None]),
        # Pool mode with whitespace, and tp=1 in both modes.
        ((" 0 , 1 ,2, 3 ", 2, 2, 0), ["0,1", "2,3"]),
        (("5,6", 2, 1, 0), ["5", "6"]),
        (("0", 3, 1, 0), ["0", "1", "2"]),
        # Template order is kept within a replica.
        (("1,0", 2, 2, 0), ["1,0", "3,2"]),
        # No explicit placement: one None per replica.
        ((None, 3, 2, 0), [None, None, None]),
        (("0,1", 0, 2, 0), []),
    ],
)
def test_split_devices_for_replicas(args, expected):
    assert siu.split_devices_for_replicas(*args) == expected


@pytest.mark.parametrize("devices", ["0,1,2", "0,1,2,3,4", "", "0"])
def test_split_devices_wrong_length_names_stage_string_and_both_lengths(devices):
    with pytest.raises(ValueError) as exc:
        siu.split_devices_for_replicas(devices, 2, 2, 7)
    msg = str(exc.value)
    assert "Stage 7" in msg and repr(devices) in msg
    assert "either 2 (template" in msg and "or 4 (pool" in msg


@pytest.mark.parametrize("devices, fragment", [
    ("0,2", "outside [0, 2)"),
    ("-1,0", "outside [0, 2)"),
    ("a,b", "must be integers"),
    ("1,1", "repeat a device"),
])
def test_split_devices_template_errors(devices, fragment):
    with pytest.raises(ValueError, match="Stage 3") as exc:
        siu.split_devices_for_replicas(devices, 2, 2, 3)
    assert fragment in str(exc.value)


def test_split_devices_pool_duplicate_within_replica_rejected():
    with pytest.raises(ValueError, match="replica 0"):
        siu.split_devices_for_replicas("0,0,1,2", 2, 2, 0)


# --------------------------------------------------------------------------- compute_replica_layout


def test_compute_replica_layout():
    stages = [
        _stage(0, runtime=SimpleNamespace(devices="0")),  # no num_replicas attribute: 1
        _stage(1, runtime=SimpleNamespace(devices="0,1", num_replicas=2), tensor_parallel_size=2),
        _stage(2, runtime={"devices": "1", "num_replicas": 0}),
        _stage(3, runtime=None),
        _stage(4, runtime={"devices": "0,1", "num_replicas": 2}, stage_type="diffusion",
               parallel_config={"world_size": 1}),
    ]
    counts, devices = siu.compute_replica_layout(stages)
    assert counts == [1, 2, 1, 1, 2]
    assert devices == {1: ["0,1", "2,3"], 4: ["0", "1"]}

    counts, devices = siu.compute_replica_layout(stages, allow_zero=True)
    assert counts == [1, 2, 0, 1, 2]
    assert 2 not in devices


def test_compute_replica_layout_errors_name_the_stage():
    with pytest.raises(ValueError, match="Stage 9: runtime.num_replicas=-1"):
        siu.compute_replica_layout([_stage(9, runtime={"num_replicas": -1})])
    with pytest.raises(ValueError, match="Stage 5"):
        siu.compute_replica_layout([_stage(5, runtime={"num_replicas": 2, "devices": "0,1,2"}, tensor_parallel_size=2)])


def test_stage_tp_and_devices_per_replica():
    assert siu.get_stage_tp_size(_stage()) == 1
    assert siu.get_stage_tp_size(_stage(tensor_parallel_size=None)) == 1
    assert siu.get_stage_tp_size(_stage(tensor_parallel_size=4)) == 4
    assert siu.get_stage_devices_per_replica(_stage(tensor_parallel_size=2)) == 2
    diffusion = _stage(stage_type="diffusion", parallel_config=SimpleNamespace(world_size=3))
    assert siu.get_stage_devices_per_replica(diffusion) == 3
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        siu.get_stage_tp_size(_stage(tensor_parallel_size=0))


# --------------------------------------------------------------------------- device locks

_HOLDER = """
    import sys
    from vllm_omni.engine.stage_init_utils import acquire_device_locks, release_device_locks
    fds = acquire_device_locks(1, {"tensor_parallel_size": 1}, 5)
    print("locked", flush=True)
    sys.stdin.readline()
    release_device_locks(fds)
    print("released", flush=True)
"""


@pytest.fixture
def lock_env(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    return {"VLLM_OMNI_LOCK_DIR": str(tmp_path / "locks"), "CUDA_VISIBLE_DEVICES": "7"}


def test_device_lock_contention_between_processes(lock_env):
    holder = _popen(_HOLDER, **lock_env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with pytest.raises(TimeoutError) as exc:
            siu.acquire_device_locks(5, {"tensor_parallel_size": 1}, 0.5)
        elapsed = time.monotonic() - start
        assert 0.5 <= elapsed < 2.0
        msg = str(exc.value)
        assert "Stage 5" in msg and "device 7" in msg and f"pid {holder.pid}" in msg

        # The holder lets go while we wait: we get the lock well within the bound.
        holder.stdin.write("go\n")
        holder.stdin.flush()
        start = time.monotonic()
        fds = siu.acquire_device_locks(5, {"tensor_parallel_size": 1}, 10)
        assert time.monotonic() - start < 5
        assert len(fds) == 1
        siu.release_device_locks(fds)
        assert holder.stdout.readline().strip() == "released"
    finally:
        siu.terminate_alive_proc(holder, timeout=2)


def test_device_locks_follow_visible_devices(lock_env, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    fds = siu.acquire_device_locks(0, {"tensor_parallel_size": 2}, 1)
    try:
        assert len(fds) == 2
        assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["device_1.lock", "device_3.lock"]
        # flock conflicts between open file descriptions even in one process.
        with pytest.raises(TimeoutError, match="device 3 "):  # first visible one
            siu.acquire_device_locks(2, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}, 0)
    finally:
        siu.release_device_locks(fds)
    siu.release_device_locks(siu.acquire_device_locks(2, {"tensor_parallel_size": 1}, 0))


def test_device_locks_edge_cases(lock_env, monkeypatch):
    with pytest.raises(RuntimeError, match="Stage 4 needs 2 device"):
        siu.acquire_device_locks(4, {"tensor_parallel_size": 2}, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert siu.acquire_device_locks(4, {"tensor_parallel_size": 2}, 1) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fds = siu.acquire_diffusion_device_locks(4, SimpleNamespace(parallel_config=SimpleNamespace(world_size=2)), 1)
    assert len(fds) == 2
    siu.release_device_locks(fds)


# --------------------------------------------------------------------------- runtime env / devices


def test_stage_runtime_env_applies_and_restores(monkeypatch):
    monkeypatch.setenv("OMNI_T_OLD", "orig")
    monkeypatch.setenv("OMNI_T_DROP", "present")
    monkeypatch.delenv("OMNI_T_NEW", raising=False)
    runtime = SimpleNamespace(env={"OMNI_T_NEW": 5, "OMNI_T_OLD": "x", "OMNI_T_FLAG": True, "OMNI_T_DROP": None})
    with siu.stage_runtime_env(0, runtime):
        assert os.environ["OMNI_T_NEW"] == "5"
        assert os.environ["OMNI_T_OLD"] == "x"
        assert os.environ["OMNI_T_FLAG"] == "1"
        assert "OMNI_T_DROP" not in os.environ
    assert "OMNI_T_NEW" not in os.environ and "OMNI_T_FLAG" not in os.environ
    assert os.environ["OMNI_T_OLD"] == "orig" and os.environ["OMNI_T_DROP"] == "present"

    with pytest.raises(KeyError, match="boom"):
        with siu.stage_runtime_env(0, {"env": {"OMNI_T_NEW": "1", "OMNI_T_OLD": "y"}}):
            raise KeyError("boom")
    assert "OMNI_T_NEW" not in os.environ and os.environ["OMNI_T_OLD"] == "orig"

    before = dict(os.environ)
    for runtime in (None, {}, SimpleNamespace(), {"env": None}):
        with siu.stage_runtime_env(0, runtime):
            assert dict(os.environ) == before
    with pytest.raises(ValueError, match="Stage 2: runtime.env"):
        with siu.stage_runtime_env(2, {"env": ["A=1"]}):
            pass


def test_stage_runtime_setup_maps_devices_through_launcher(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("OMNI_T_NEW", raising=False)
    with siu.stage_runtime_setup(1, {"devices": "2,0", "env": {"OMNI_T_NEW": "1"}}):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,4"
        assert os.environ["OMNI_T_NEW"] == "1"
    assert "OMNI_T_NEW" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,4"  # restoring it is the caller's job

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match="Stage 1: runtime.devices='2' uses index 2"):
        with siu.stage_runtime_setup(1, SimpleNamespace(devices="2", env=None)):
            pass
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with siu.stage_runtime_setup(1, SimpleNamespace(devices=1)):  # bare YAML int
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with siu.stage_runtime_setup(1, SimpleNamespace(devices=None)):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


# --------------------------------------------------------------------------- processes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_set_death_signal_child_dies_with_parent():
    parent = _popen("""
        import subprocess, sys, textwrap, time
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent('''
            import signal, time
            from vllm_omni.engine.stage_init_utils import set_death_signal
            set_death_signal(signal.SIGKILL)
            print("ready", flush=True)
            time.sleep(60)
        ''')], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    child_pid = int(parent.stdout.readline())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=5)
        deadline = time.monotonic() + 5
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by init) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_set_death_signal_never_raises():
    siu.set_death_signal(0)  # 0 clears the death signal: valid
    siu.set_death_signal(10_000)  # invalid signal: logged, not raised


_IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); ready(); time.sleep(60)"


def test_terminate_alive_proc_kills_popen_ignoring_sigterm():
    proc = _popen("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    siu.terminate_alive_proc(proc, timeout=0.5)
    assert time.monotonic() - start < 3
    assert proc.returncode == -signal.SIGKILL
    siu.terminate_alive_proc(proc, timeout=0.5)  # already dead: no-op


def test_terminate_alive_proc_kills_mp_process_ignoring_sigterm():
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    # exec as the target keeps the child free of this test module's imports.
    proc = ctx.Process(target=exec, args=(_IGNORE_TERM, {"ready": ready.set}), daemon=True)
    proc.start()
    assert ready.wait(10)
    start = time.monotonic()
    siu.terminate_alive_proc(proc, timeout=0.5)
    assert time.monotonic() - start < 3
    assert proc.exitcode == -signal.SIGKILL


def test_terminate_alive_proc_polite_process_stops_on_sigterm():
    proc = _popen("import time; print('ready', flush=True); time.sleep(60)")
    assert proc.stdout.readline().strip() == "ready"
    siu.terminate_alive_proc(proc, timeout=5)
    assert proc.returncode == -signal.SIGTERM


def test_prepare_engine_environment_sets_spawn_idempotently():
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import multiprocessing as mp
            from vllm_omni.engine.stage_init_utils import prepare_engine_environment
            prepare_engine_environment(); prepare_engine_environment()
            print(mp.get_start_method(allow_none=True))
        """)],
        capture_output=True, text=True, env=_child_env(), timeout=30, check=True,
    )
    assert out.stdout.strip() == "spawn"


# --------------------------------------------------------------------------- metadata / imports


def bridge(*args):  # a stand-in stage input processor
    return args


def _qwen_talker_stage(**overrides):
    cfg = dict(
        stage_id=1,
        runtime=SimpleNamespace(process=True, devices="1", max_batch_size=3),
        engine_args=SimpleNamespace(model_stage="talker", engine_output_type="latent", worker_type="ar"),
        engine_input_source=[0],
        custom_process_input_func="os.path.join",
        final_output=False,
        final_output_type=None,
        is_comprehension=False,
        default_sampling_params={"temperature": 0.9, "stop_token_ids": [8294]},
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def test_extract_stage_metadata():
    stage = _qwen_talker_stage()
    meta = siu.extract_stage_metadata(stage)
    assert meta.stage_id == 1 and meta.stage_type == "llm"
    assert meta.model_stage == "talker" and meta.engine_output_type == "latent"
    assert meta.engine_input_source == [0]
    assert meta.custom_process_input_func is os.path.join
    assert meta.final_output is False and meta.is_comprehension is False
    assert meta.requires_multimodal_data is False
    assert meta.default_sampling_params is stage.default_sampling_params
    assert meta.runtime_cfg is stage.runtime
    assert meta.replica_id == 0 and meta.prompt_expand_func is None

    meta = siu.extract_stage_metadata(_qwen_talker_stage(custom_process_input_func=bridge, stage_type="diffusion",
                                                         requires_multimodal_data=True))
    assert meta.custom_process_input_func is bridge and meta.stage_type == "diffusion"
    assert meta.requires_multimodal_data is True

    with pytest.raises(ValueError, match="Stage 1: stage_type='video'"):
        siu.extract_stage_metadata(_qwen_talker_stage(stage_type="video"))


@pytest.mark.parametrize("path, error, fragment", [
    ("no_such_pkg_xyz.mod.fn", ImportError, "'no_such_pkg_xyz.mod.fn'"),
    ("os.path.no_such_fn", ImportError, "has no attribute 'no_such_fn'"),
    ("nodots", ValueError, "'nodots'"),
])
def test_import_dotted_errors_name_the_path(path, error, fragment):
    with pytest.raises(error) as exc:
        siu.import_dotted(path)
    assert fragment in str(exc.value)
    with pytest.raises(error):
        siu.extract_stage_metadata(_qwen_talker_stage(custom_process_input_func=path))


def test_import_dotted_forms():
    assert siu.import_dotted("os.path.join") is os.path.join
    assert siu.import_dotted("os.path:join") is os.path.join
    assert siu.import_dotted("types:SimpleNamespace.__init__") is types.SimpleNamespace.__init__


# --------------------------------------------------------------------------- engine args


@dataclass(frozen=True)
class _EngineArgs:
    model_stage: str = "thinker"
    worker_type: str | None = "ar"
    worker_cls: str | None = None
    tensor_parallel_size: int | None = None
    tokenizer: str | None = None
    omni_kv_config: dict | None = field(default_factory=lambda: {"need_send_cache": True})


def test_build_engine_args_dict_from_frozen_dataclass():
    stage = SimpleNamespace(stage_id=0, engine_args=_EngineArgs())
    spec = {"name": "SharedMemoryConnector", "extra": {}}
    args = siu.build_engine_args_dict(stage, "/models/qwen", stage_connector_spec=spec, cli_tokenizer="/tok")
    assert args["model"] == "/models/qwen" and args["stage_id"] == 0
    assert args["worker_cls"] == "vllm_omni.worker.gpu_ar_worker.GPUARWorker"
    assert args["tokenizer"] == "/tok"
    assert args["stage_connector_spec"] == spec and args["stage_connector_spec"] is not spec
    assert "tensor_parallel_size" not in args  # None means "engine default"
    args["omni_kv_config"]["x"] = 1
    assert "x" not in stage.engine_args.omni_kv_config  # a detached copy

    own_tokenizer = SimpleNamespace(stage_id=0, engine_args=_EngineArgs(tokenizer="/own", worker_cls="my.Worker"))
    args = siu.build_engine_args_dict(own_tokenizer, "m", cli_tokenizer="/tok")
    assert args["tokenizer"] == "/own" and args["worker_cls"] == "my.Worker"
    assert "stage_connector_spec" not in args


def test_build_engine_args_dict_from_dict_and_object():
    engine_args = {"worker_type": "generation", "tensor_parallel_size": 2}
    args = siu.build_engine_args_dict(SimpleNamespace(stage_id=2, engine_args=engine_args), "m")
    assert args["worker_cls"] == "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"
    assert args["tensor_parallel_size"] == 2 and "model" not in engine_args

    plain = SimpleNamespace(worker_type="ar", _private=1)
    args = siu.build_engine_args_dict(SimpleNamespace(stage_id=0, stage_type="diffusion", engine_args=plain), "m")
    assert "worker_cls" not in args and "_private" not in args  # diffusion stages pick their own worker


def test_resolve_worker_cls_and_cli_tokenizer():
    args = {"worker_type": "AR", "worker_cls": "auto"}
    siu.resolve_worker_cls(args)
    assert args["worker_cls"] == siu.AR_WORKER_CLS
    args = {}
    siu.resolve_worker_cls(args)
    assert args == {}
    with pytest.raises(ValueError, match="worker_type='gpu'"):
        siu.resolve_worker_cls({"worker_type": "gpu"})
    args = {}
    siu.apply_cli_tokenizer(args, cli_tokenizer=None, stage_defines_tokenizer=False)
    assert args == {}
    siu.apply_cli_tokenizer(args, cli_tokenizer="t", stage_defines_tokenizer=True)
    assert args == {}


def test_get_stage_connector_spec():
    config = SimpleNamespace(connectors={
        ("0", "1"): SimpleNamespace(name="SharedMemoryConnector", extra={"shm_threshold_bytes": 65536}),
        ("1", "2"): {"name": "MooncakeConnector", "extra": None},
    })
    assert siu.get_stage_connector_spec(config, 1, async_chunk=False) == {}
    assert siu.get_stage_connector_spec(config, 1, async_chunk=True) == {
        "name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": 65536}}
    assert siu.get_stage_connector_spec({"connectors": config.connectors}, 2, True) == {
        "name": "MooncakeConnector", "extra": {}}
    assert siu.get_stage_connector_spec(config, 0, True) == {}
    assert siu.get_stage_connector_spec(None, 0, True) == {}


# --------------------------------------------------------------------------- inject_kv_stage_info


def test_inject_kv_stage_info_receiver_in_place():
    thinker = _stage(0, tensor_parallel_size=2)
    kv = {"need_recv_cache": True}
    talker = _stage(1, tensor_parallel_size=1, omni_kv_config=kv)
    talker.engine_input_source = [0]
    out = siu.inject_kv_stage_info(talker, 1, [thinker, talker])
    assert out is kv
    assert kv == {"need_recv_cache": True, "stage_id": 1, "engine_input_source": [0],
                  "rank_mapping": {"from_tp": 2, "to_tp": 1}}


def test_inject_kv_stage_info_sender_and_user_values_win():
    kv = {"omni_from_stage": 0, "omni_to_stage": 1, "stage_id": 0, "rank_mapping": {"to_tp": 8}}
    thinker = _stage(0, tensor_parallel_size=2, omni_kv_config=kv)
    talker = _stage(1, tensor_parallel_size=4)
    siu.inject_kv_stage_info(thinker, 0, [thinker, talker])
    assert kv["rank_mapping"] == {"from_tp": 2, "to_tp": 8}
    assert "engine_input_source" not in kv  # stage has none

    kv = {"omni_from_stage": 0, "omni_to_stage": 1}
    talker = _stage(1, tensor_parallel_size=4, omni_kv_config=kv)
    siu.inject_kv_stage_info(talker, 1, [_stage(0, tensor_parallel_size=2), talker])
    assert kv["rank_mapping"] == {"from_tp": 2, "to_tp": 4}


def test_inject_kv_stage_info_frozen_config_returns_dict():
    readonly = MappingProxyType({"need_recv_cache": True})
    stage = SimpleNamespace(stage_id=1, engine_input_source=[0],
                            engine_args=dataclasses.replace(_EngineArgs(), omni_kv_config=readonly))
    out = siu.inject_kv_stage_info(stage, 1)
    assert out == {"need_recv_cache": True, "stage_id": 1, "engine_input_source": [0]}
    assert stage.engine_args.omni_kv_config is readonly and "stage_id" not in readonly

    assert siu.inject_kv_stage_info(_stage(0), 0) is None  # no KV transfer configured


def test_helpers_read_our_frozen_stage_configs_by_their_fields(monkeypatch):
    """The runtime hands the helpers its typed StageConfig (no dict round trip): a diffusion
    stage's replica spans its CFG ranks, runtime.env and runtime.devices apply as configured."""
    from vllm_omni.config.stage_config import StageConfig, StageEngineArgs, StageRuntimeConfig, WorkerType

    runtime = StageRuntimeConfig(devices="1,0", env=(("OMNI_T_TYPED", "yes"),))
    diffusion = StageConfig(stage_id=3, runtime=runtime, default_sampling_params=None, engine_args=StageEngineArgs(
        worker_type=WorkerType.DIFFUSION, cfg_parallel_size=2))
    ar = StageConfig(stage_id=4, runtime=runtime, default_sampling_params=None,
                     engine_args=StageEngineArgs(tensor_parallel_size=2))
    assert siu.get_stage_devices_per_replica(diffusion) == 2 and siu.get_stage_tp_size(diffusion) == 1
    assert siu.get_stage_devices_per_replica(ar) == siu.get_stage_tp_size(ar) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    monkeypatch.delenv("OMNI_T_TYPED", raising=False)
    with siu.stage_runtime_setup(3, runtime):
        assert os.environ["OMNI_T_TYPED"] == "yes" and os.environ["CUDA_VISIBLE_DEVICES"] == "6,5"
    assert "OMNI_T_TYPED" not in os.environ
