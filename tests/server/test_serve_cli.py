"""`vllm-omni serve` / `vllm serve --omni` flags: spec 001's OmniConfig flags with their documented
defaults, in --help, and each one implemented or refused at startup by name (no server starts)."""
from __future__ import annotations

import argparse

import pytest

from vllm_omni.config import STAGE_CLI_FIELDS
from vllm_omni.entrypoints.cli import serve_args
from vllm_omni.entrypoints.cli.main import build_parser, main
from vllm_omni.entrypoints.cli.serve import vllm_main

# spec 001, "OmniConfig": flag -> documented default (aliases after the name).
SPEC_DEFAULTS = {
    "--omni": False, "--enable-sleep-mode": False, "--task-type": None, "--stage-configs-path": None,
    "--deploy-config": None, "--stage-overrides": None, "--async-chunk": None, "--stage-id": None,
    "--replica-id": None, "--stage-init-timeout": 300, "--init-timeout": 600, "--shm-threshold-bytes": 65536,
    "--log-stats": False, "--log-file": None, "--batch-timeout": 10, "--worker-backend": "multi_process",
    "--ray-address": None, "--omni-master-address -oma": None, "--omni-master-port -omp": None,
    "--omni-replica-address -ora": None, "--omni-dp-size-local": 1, "--omni-lb-policy": "random",
    # Spec 001 documents 30.0; issues 12 and 41 ask for a few seconds, so that a frozen stage is
    # reported within 5 s (docs/operations.md). The one deliberate deviation.
    "--omni-heartbeat-timeout": 3.0, "--num-gpus": None, "--model-class-name": None,
    "--diffusion-load-format": None, "--diffusers-load-kwargs": {}, "--diffusers-call-kwargs": {},
    "--usp --ulysses-degree": None, "--ulysses-mode": "strict", "--ring --ring-degree": None,
    "--diffusion-quantization-config": None, "--force-cutlass-fp8": None, "--use-hsdp": False,
    "--hsdp-shard-size": -1, "--hsdp-replicate-size": 1, "--diffusion-attention-backend": None,
    "--diffusion-attention-config -dac": None, "--cache-backend": "none", "--cache-config": None,
    "--enable-cache-dit-summary": False, "--step-execution": False, "--vae-use-slicing": False,
    "--vae-use-tiling": False, "--disable-multithread-weight-load": True, "--num-weight-load-threads": 4,
    "--enable-cpu-offload": False, "--enable-layerwise-offload": False, "--boundary-ratio": None,
    "--flow-shift": None, "--diffusion-kv-cache-dtype": None, "--diffusion-kv-cache-skip-steps": None,
    "--diffusion-kv-cache-skip-layers": None, "--cfg-parallel-size": 1, "--vae-patch-parallel-size": 1,
    "--default-sampling-params": None, "--max-generated-image-size": None, "--tts-max-instructions-length": None,
    "--no-guardrails": False, "--enable-diffusion-pipeline-profiler": False, "--enable-ar-profiler": False,
    "--auxiliary-text-encoder": None,
}
MUST_IMPLEMENT = ["--port", "--host", "--stage-configs-path", "--deploy-config", "--stage-overrides",
                  "--stage-init-timeout", "--init-timeout", "--shm-threshold-bytes", "--log-stats", "--log-file",
                  "--batch-timeout", "--served-model-name", "--api-key", "--max-num-seqs", "--worker-backend",
                  "--ray-address"]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    return parser


def all_flags():
    return (*serve_args.OMNI_FLAGS, *serve_args.SERVER_FLAGS, *serve_args.ENGINE_FLAGS)


def test_every_spec_flag_parses_to_its_documented_default():
    args = serve_parser().parse_args([])
    by_names = {" ".join(f.names): f for f in serve_args.OMNI_FLAGS}
    assert set(by_names) == set(SPEC_DEFAULTS)
    for names, default in SPEC_DEFAULTS.items():
        assert getattr(args, by_names[names].dest) == default, names
    aliases = serve_parser().parse_args(["-oma", "h", "-omp", "1", "-ora", "a", "--usp", "2", "--ring", "3",
                                         "-dac", "{}", "-tp", "2"])
    assert (aliases.omni_master_address, aliases.omni_master_port, aliases.omni_replica_address) == ("h", 1, "a")
    assert (aliases.ulysses_degree, aliases.ring_degree, aliases.diffusion_attention_config) == (2, 3, {})
    assert aliases.tensor_parallel_size == 2


def test_help_lists_every_flag_with_its_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in all_flags():
        for name in flag.names:
            assert name in out, name
    # Every diffusion flag is implemented now (parallelism, layerwise offload); Cosmos3's is not.
    assert "Cosmos3 is not supported" in " ".join(out.split()) and "admission queue" in out
    assert "the diffusion engine does not implement" not in out
    assert "serve" in build_parser().format_help()


def test_every_refused_flag_is_named_at_startup():
    for flag in (*serve_args.OMNI_FLAGS, *serve_args.SERVER_FLAGS):
        if flag.refused is None:
            continue
        args = serve_parser().parse_args(_non_default(flag))
        problems = serve_args.refused_flags(args)
        assert len(problems) == 1 and problems[0].startswith(flag.names[0]), (flag.names, problems)
        assert flag.refused in problems[0]


def test_implemented_flags_and_engine_flags():
    implemented = {n for f in all_flags() if f.refused is None for n in f.names}
    assert set(MUST_IMPLEMENT) <= implemented
    # Engine flags are exactly the stage fields the config layer accepts from the CLI.
    # (--omni-dp-size-local sets num_replicas.)
    assert {f.dest for f in serve_args.ENGINE_FLAGS} | set(serve_args.STAGE_SETTING_FLAGS) | {"num_replicas"} \
        == set(STAGE_CLI_FIELDS)
    args = serve_parser().parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager"])
    assert serve_args.engine_args(args) == {"max_num_seqs": 8, "enable_prefix_caching": False, "enforce_eager": True}
    args = serve_parser().parse_args(["--omni-dp-size-local", "2", "--omni-lb-policy", "least-queue-length"])
    assert serve_args.refused_flags(args) == [] and serve_args.engine_args(args) == {"num_replicas": 2}


@pytest.mark.parametrize("argv, message", [
    (["--headless"], "--headless needs --stage-id"),
    (["--ray-address", "auto"], "a Ray address (--ray-address) needs --worker-backend ray"),
    (["--stage-configs-path", "a.yaml", "--deploy-config", "b.yaml"], "mutually exclusive"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be >= 1"),
])
def test_serve_refuses_before_starting_anything(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllm_script_only_serves_with_omni(capsys):
    assert vllm_main([]) == 2
    assert vllm_main(["chat"]) == 2
    assert "only runs `vllm serve [MODEL] --omni" in capsys.readouterr().err
    assert vllm_main(["serve", "some/model"]) == 2
    assert "add --omni" in capsys.readouterr().err
    assert vllm_main(["serve", "--omni", "--headless", "--stage-id", "2"]) == 2
    assert "--headless needs --omni-master-address" in capsys.readouterr().err


def _non_default(flag: serve_args.Flag) -> list[str]:
    kw = flag.kwargs
    if kw.get("action") == "store_true":
        return [flag.names[0]] if kw.get("default") is not True else []
    if kw.get("action") is argparse.BooleanOptionalAction:
        return [flag.names[0]]
    if "choices" in kw:
        return [flag.names[0], str(next(c for c in kw["choices"] if c != kw.get("default")))]
    if kw.get("type") in (int, float):
        return [flag.names[0], "7"]
    if kw.get("type") is serve_args._json_object:
        return [flag.names[0], '{"a": 1}']
    return [flag.names[0], "x"]


def test_flags_reach_async_omni(monkeypatch):
    """The pipeline flags become AsyncOmni's arguments (the contract), engine flags its **engine_args."""
    import vllm_omni.entrypoints.async_omni as async_omni
    from vllm_omni.entrypoints.cli import serve

    seen = {}
    monkeypatch.setattr(async_omni, "AsyncOmni", lambda **kw: seen.update(kw))
    args = serve_parser().parse_args([
        "m", "--stage-configs-path", "s.yaml", "--stage-overrides", '{"0": {"max_num_seqs": 2}}',
        "--stage-init-timeout", "30", "--init-timeout", "60", "--shm-threshold-bytes", "1024", "--log-stats",
        "--max-num-seqs", "8", "--dtype", "float32", "--no-async-chunk", "--worker-backend", "ray",
        "--ray-address", "auto"])
    policy = object()  # the server's MediaPolicy, which the input processor reads media under
    serve._start_engine(args, "m", policy)
    assert seen == {"media_policy": policy, "model": "m", "stage_configs_path": "s.yaml", "deploy_config": None,
                    "stage_overrides": '{"0": {"max_num_seqs": 2}}', "stage_init_timeout": 30.0,
                    "init_timeout": 60.0, "shm_threshold_bytes": 1024, "log_stats": True, "async_chunk": False,
                    "heartbeat_timeout": 3.0, "max_stage_restarts": 3, "lb_policy": "random",
                    "worker_backend": "ray", "ray_address": "auto", "max_num_seqs": 8, "dtype": "float32",
                    "stage_id": None, "master_address": None, "master_port": None, "omni_secret_file": None,
                    "max_message_bytes": 1 << 30, "max_replicas_per_stage": 16, "registration_rate": 10.0,
                    "admission_policy": "off", "admission_headroom": 0.2, "admission_max_wait": 10}
