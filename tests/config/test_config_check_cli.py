"""`vllm-omni check-config` run as a real subprocess on good and bad files."""
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_omni.config.bundled import DEPLOY_DIR

SPEC_EXAMPLE = Path(__file__).parent / "data" / "spec000_qwen2_5_omni.yaml"


def check_config(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "check-config", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_spec_example_prints_the_graph():
    out = check_config(str(SPEC_EXAMPLE), "--no-import")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(legacy format)" in text
    assert "0   thinker      ar          latent  0        yes      1      0.80" in text
    assert "2   code2wav     generation  audio   0        yes      1      0.15" in text
    assert "0 -> 1  window_size=-1 (whole output)" in text and "1 -> 2  window_size=-1" in text
    assert "stage 0 (thinker): text" in text and "stage 2 (code2wav): audio" in text
    assert "stage 1 (talker)" not in text.split("Final outputs")[1]
    assert text.rstrip().endswith("OK")


def test_plugins_resolve(tmp_path):
    pkg = tmp_path / "cc_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parts.py").write_text("class Sched:\n    pass\nclass Worker:\n    pass\nclass Model:\n    pass\n"
                                  "def bridge(*args):\n    return []\n")
    config = tmp_path / "plugin.yaml"
    config.write_text("""\
stage_args:
  - stage_id: 0
    engine_args: {model_arch: cc_plugins.parts.Model, worker_cls: cc_plugins.parts.Worker}
  - stage_id: 1
    engine_input_source: [0]
    custom_process_input_func: cc_plugins.parts.bridge
    engine_args: {model_arch: cc_plugins.parts.Model, worker_cls: cc_plugins.parts.Worker, worker_type: generation}
    final_output_type: audio
""")
    out = check_config(str(config), pythonpath=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "Dotted names: all resolve" in out.stdout and "input=cc_plugins.parts.bridge" in out.stdout
    bad = tmp_path / "bad_plugin.yaml"
    bad.write_text(config.read_text().replace("cc_plugins.parts.bridge", "cc_plugins.parts.brige"))
    out = check_config(str(bad), pythonpath=str(tmp_path))
    assert out.returncode == 1
    assert "stage 1: custom_process_input_func='cc_plugins.parts.brige'" in out.stderr
    assert "has no attribute 'brige'" in out.stderr and "allowed: Model, Sched, Worker, bridge" in out.stderr


def test_bad_file_fails_with_the_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage_args:\n  - stage_id: 0\n    engine_args: {gpu_memory_utilization: 2}\n")
    out = check_config(str(bad))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (f"error: {bad}: stage 0: engine_args.gpu_memory_utilization=2: "
                                  "invalid value; allowed: a number in (0, 1]")


def test_bundled_by_model_with_overrides_and_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    out = check_config("--model", str(tmp_path), "--no-import", "--json", "--platform", "npu",
                       "--stage-overrides", '{"2": {"max_num_seqs": 3}}', "--no-async-chunk")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["format"] == "deploy" and data["pipeline_name"] == "qwen3_omni_moe"
    assert data["async_chunk"] is False
    assert data["stages"][0]["engine_args"]["max_num_batched_tokens"] == 8192  # the npu delta
    assert data["stages"][2]["engine_args"]["gpu_memory_utilization"] == 0.3
    assert data["stages"][2]["engine_args"]["max_num_seqs"] == 3
    assert [e["connector"] for e in data["edges"]] == ["connector_of_shared_memory"] * 2


def test_bad_stage_overrides_and_deploy_without_model():
    out = check_config(str(DEPLOY_DIR / "qwen2_5_omni.yaml"), "--no-import",
                       "--stage-overrides", '{"1": {"max_num_seqs": "four"}}')
    assert out.returncode == 1
    assert "error: --stage-overrides: stage 1: max_num_seqs='four'" in out.stderr
    out = check_config("--no-import")
    assert out.returncode == 1 and "no stage config given and no model" in out.stderr
