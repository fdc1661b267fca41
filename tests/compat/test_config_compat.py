"""Upstream-format stage configs (our own copies, tests/compat/data) load as written; every key
is honoured, ignored with one warning, or refused by name with the reason, at parse time.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config, validate_dotted_names
from vllm_omni.config import loader

DATA = Path(__file__).parent / "data"
V012 = DATA / "qwen3_omni_moe_v012.yaml"
DEPLOY = DATA / "qwen2_5_omni_deploy_2026.yaml"
# file -> (family of the tiny checkpoint a deploy file needs, the keys ignored with a warning)
FILES = {
    "qwen3_omni_moe_v012.yaml": (None, {"engine_args.distributed_executor_backend", "engine_args.hf_config_name"}),
    "qwen2_5_omni_ci_v012.yaml": (None, {"engine_args.skip_mm_profiling",
                                         "runtime.connectors.shared_memory_connector.extra.shm_threshold_bytes"}),
    "qwen3_omni_ci_async_chunk_2026.yaml": (None, {
        "engine_args.distributed_executor_backend", "engine_args.hf_config_name", "engine_args.mm_processor_cache_gb",
        "engine_args.custom_process_next_stage_input_func", "engine_args.async_scheduling"}),
    "qwen2_5_omni_deploy_2026.yaml": ("qwen2_5_omni", {"distributed_executor_backend", "mm_processor_cache_gb",
                                                       "enable_flashinfer_autotune", "async_scheduling"}),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_upstream_format_files_load_as_written(name, tiny_model, caplog):
    family, ignored = FILES[name]
    with caplog.at_level(logging.WARNING, logger="vllm_omni.config.loader"):
        p = load_pipeline_config(DATA / name, model=str(tiny_model(family)) if family else None)
    validate_dotted_names(p)  # every class and bridge named imports
    assert [s.model_stage for s in p.stages] == ["thinker", "talker", "code2wav"]
    assert [s.worker_type.value for s in p.stages] == ["ar", "ar", "generation"]
    assert {i.field for i in p.ignored} == ignored
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and all(key in warnings[0].getMessage() for key in ignored)


def test_check_config_prints_what_is_ignored():
    out = subprocess.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "check-config", str(V012)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Ignored (no effect on this engine):" in out.stdout
    assert ("engine_args.hf_config_name (stages 0, 1, 2): each stage model reads its own part of the "
            "checkpoint's config") in out.stdout
    assert out.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("platform", ["cuda", "cpu", "rocm", "xpu"])
def test_another_platforms_section_never_blocks(platform, tiny_model):
    # The NPU section asks for tensor and expert parallelism, which no stage here runs.
    p = load_pipeline_config(DEPLOY, model=str(tiny_model("qwen2_5_omni")), platform=platform)
    assert p.stage(2).runtime.devices == ("2" if platform == "rocm" else "0")
    assert ("platforms.xpu.stages" not in str(p.ignored)) and (
        any(i.field == "max_cudagraph_capture_size" for i in p.ignored) == (platform == "xpu"))


def test_the_current_platforms_section_is_read_in_full(tiny_model):
    with pytest.raises(ConfigError, match=r"\(platforms.npu\): stage 0: enable_expert_parallel=True: is a vLLM engine "
                                          r"argument that this engine does not implement: expert parallelism"):
        load_pipeline_config(DEPLOY, model=str(tiny_model("qwen2_5_omni")), platform="npu")


# (file, old text, new text, what the error says)
REFUSED = [
    (V012, "stage_type: llm  #", "stage_type: diffusion  #",
     "engine_args.worker_cls='vllm_omni.worker.gpu_ar_worker.GPUARWorker': is a 'ar' class but the stage's "
     "worker_type is 'diffusion'"),
    (V012, "worker_cls: vllm_omni.worker.gpu_ar_worker.GPUARWorker",
     "worker_cls: vllm_omni.worker.npu.npu_ar_worker.NPUARWorker",
     "engine_args.worker_cls='vllm_omni.worker.npu.npu_ar_worker.NPUARWorker': Ascend NPU worker classes are "
     "not supported"),
    (V012, "scheduler_cls: vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
     "scheduler_cls: vllm_omni.core.sched.scheduler.OmniScheduler",
     "scheduler_cls 'vllm_omni.core.sched.scheduler.OmniScheduler' is not supported: the scheduler is part of "
     "the stage engine"),
    (V012, "stage_input_processors.qwen3_omni.thinker2talker\n",
     "stage_input_processors.qwen3_omni.thinker2talker_async_chunk\n",
     "custom_process_input_func='vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_"
     "async_chunk': module 'vllm_omni.model_executor.stage_input_processors.qwen3_omni' has no "
     "'thinker2talker_async_chunk'"),
    (V012, "tensor_parallel_size: 1", "tensor_parallel_size: 1\n      quantization: fp8",
     "engine_args.quantization='fp8': is a vLLM engine argument that this engine does not implement: quantized "
     "checkpoints are not supported; allowed: null (off)"),
    (V012, "tensor_parallel_size: 1", "tensor_parallel_size: 1\n      kv_transfer_config: {kv_connector: X}",
     "kv_transfer_config is not supported: prefill/decode disaggregation"),
    (V012, "    final_output: true\n    final_output_type: text",
     "    is_prefill_only: true\n    final_output: true\n    final_output_type: text",
     "stage 0: is_prefill_only=True: is_prefill_only is not supported: prefill/decode disaggregation"),
    (V012, "tensor_parallel_size: 1", "tensor_parallel_size: 1\n      cache_backend: tea_cache",
     "engine_args.cache_backend='tea_cache': is a diffusion setting and this pipeline has no diffusion stage"),
    (DATA / "qwen2_5_omni_ci_v012.yaml", "name: SharedMemoryConnector", "name: MooncakeConnector",
     "runtime.connectors.shared_memory_connector.name='MooncakeConnector': MooncakeConnector is not supported"),
    (DEPLOY, "async_chunk: false", "async_chunk: false\nsession_mode: duplex",
     "session_mode='duplex': session_mode is not supported: full-duplex sessions are not supported"),
    (DEPLOY, "async_chunk: false", "async_chunk: false\ncustom_voice_dir: /voices",
     "custom_voice_dir is not supported: our Qwen3-TTS stages do not implement it"),
]


@pytest.mark.parametrize("path, old, new, expected", REFUSED, ids=[r[3][:40] for r in REFUSED])
def test_refused_by_name_when_parsed(path, old, new, expected, tmp_path, tiny_model):
    text = path.read_text()
    assert old in text
    (tmp_path / path.name).write_text(text.replace(old, new))
    model = str(tiny_model("qwen2_5_omni")) if path == DEPLOY else None
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_pipeline_config(tmp_path / path.name, model=model)


def test_values_that_describe_this_engine_are_accepted_silently(tmp_path):
    text = V012.read_text().replace("tensor_parallel_size: 1", "tensor_parallel_size: 1\n      quantization: null\n"
                                    "      pipeline_parallel_size: 1\n      enable_lora: false\n"
                                    "      kv_cache_dtype: auto")
    (tmp_path / "noop.yaml").write_text(text)
    p = load_pipeline_config(tmp_path / "noop.yaml")
    assert {i.field for i in p.ignored} == FILES[V012.name][1]


def test_devices_are_checked_against_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "visible_device_count", lambda platform: 1)
    with pytest.raises(ConfigError, match=re.escape("stage 1: runtime.devices='1': device 1 does not exist on "
                                                    "this machine: 1 visible (0)")):
        load_pipeline_config(V012, check_devices=True)
    one_gpu = V012.read_text().replace('devices: "1"', 'devices: "0"')
    (tmp_path / "one_gpu.yaml").write_text(one_gpu)
    assert load_pipeline_config(tmp_path / "one_gpu.yaml", check_devices=True).num_stages == 3


def test_check_config_checks_this_machines_devices(tmp_path):
    """Without --platform, check-config reads the config for this machine: here a CPU, whose
    stages run wherever `devices` point (so nothing to refuse); naming a platform never checks."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for extra in ([], ["--platform", "cuda"]):
        out = subprocess.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "check-config", str(V012),
                              "--no-import", *extra], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr


def test_the_documented_tables_name_every_key():
    from vllm_omni.config import upstream_keys

    doc = (Path(__file__).parents[2] / "docs" / "compatibility.md").read_text()
    keys = [*upstream_keys.IGNORED_ENGINE_ARGS, *upstream_keys.REFUSED_ENGINE_ARGS,
            *(k for k in upstream_keys.UNSUPPORTED_FEATURES if k not in upstream_keys.DIFFUSION_KEYS)]
    assert [k for k in keys if f"`{k}`" not in doc] == []


def test_upstreams_thinker_layout_with_tensor_parallel_parses(tmp_path):
    """Upstream's own Qwen3-Omni thinker: two devices, tensor_parallel_size 2."""
    text = V012.read_text().replace('devices: "0"\n      max_batch_size: 4\n    engine_args:\n      model_stage: thinker',
                                    'devices: "0,1"\n      max_batch_size: 4\n    engine_args:\n      model_stage: thinker')
    (tmp_path / V012.name).write_text(text.replace("tensor_parallel_size: 1", "tensor_parallel_size: 2", 1))
    assert load_pipeline_config(tmp_path / V012.name).stage(0).engine_args.tensor_parallel_size == 2
