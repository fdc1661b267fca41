"""The bundled Qwen2.5-Omni configs: the spec 000 YAML kept verbatim, the deploy YAML equivalent
to it, the single-GPU variant and the thinker-only variant, and when each is chosen."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni.config import load_pipeline_config, pipeline_for_model
from vllm_omni.config.bundled import DEPLOY_DIR, STAGE_CONFIGS_DIR
from vllm_omni.engine.stage_input import resolve_input_processor

SPEC_YAML = Path(__file__).parent / "data" / "spec000_qwen2_5_omni.yaml"  # copied from spec 000
OMNI = {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniModel"]}
BRIDGES = "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni"


@pytest.fixture(autouse=True)
def eight_gpus(monkeypatch):
    # The bundled choice depends on the visible GPU count; pin it so the test means the same anywhere.
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 8)


def stage_settings(pipeline) -> list[tuple]:
    """What decides how each stage runs, in comparable form (batch: what the engine gets)."""
    return [(s.stage_id, s.model_stage, s.worker_type, s.engine_input_source, s.final_output, s.final_output_type,
             s.engine_args.engine_output_type, s.runtime.devices, s.engine_args.gpu_memory_utilization,
             vars(s.default_sampling_params), s.engine_args.max_num_seqs or s.runtime.max_batch_size)
            for s in pipeline.stages]


def test_spec_yaml_is_bundled_verbatim():
    assert (STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml").read_text() == SPEC_YAML.read_text()


def test_deploy_yaml_is_equivalent_to_the_spec_yaml():
    legacy = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml", platform="cuda")
    deploy = load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", platform="cuda")
    default = load_pipeline_config(model=OMNI, platform="cuda")  # what Omni(model=...) loads
    assert stage_settings(deploy) == stage_settings(legacy) == stage_settings(default)
    assert [e.window_size for e in deploy.edges] == [e.window_size for e in legacy.edges] == [-1, -1]
    # The spec YAML names the talker's bridge only; code2wav gets the model's own from the registry.
    names = [resolve_input_processor(s)[1] for s in legacy.stages[1:]]
    assert names == [f"{BRIDGES}.thinker2talker", f"{BRIDGES}.talker2code2wav"]


@pytest.mark.parametrize("platform", ["cuda", "rocm", "npu", "xpu"])
def test_single_gpu_variant(platform):
    legacy = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni_single_gpu.yaml", platform=platform)
    deploy = load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni_single_gpu.yaml", platform=platform)
    for p in (legacy, deploy):
        assert [s.runtime.devices for s in p.stages] == ["0", "0", "0"]
        assert sum(s.engine_args.gpu_memory_utilization for s in p.stages) < 1
    if platform == "cuda":  # other platforms keep their own eager/cudagraph choices
        assert stage_settings(deploy) == stage_settings(legacy)
    full = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml")
    drop = lambda p: [t[:7] + t[9:] for t in stage_settings(p)]  # noqa: E731 - all but devices, memory
    assert drop(legacy) == drop(full)


def test_thinker_only_variant():
    p = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni_thinker_only.yaml")
    [thinker] = p.stages
    assert thinker.model_stage == "thinker" and thinker.final_output and thinker.final_output_type.value == "text"
    assert thinker.engine_args.engine_output_type.value == "text"  # no hidden states for a talker
    full = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml")
    assert vars(thinker.default_sampling_params) == vars(full.stages[0].default_sampling_params)


@pytest.mark.parametrize("hf, kwargs, expected", [
    (OMNI, {}, "qwen2_5_omni"),
    (OMNI, {"audio_output": True, "num_devices": 8}, "qwen2_5_omni"),
    (OMNI, {"num_devices": 1}, "qwen2_5_omni_single_gpu"),
    (OMNI, {"audio_output": False}, "qwen2_5_omni_thinker_only"),
    (OMNI, {"audio_output": False, "num_devices": 1}, "qwen2_5_omni_thinker_only"),
    ({**OMNI, "enable_audio_output": False}, {}, "qwen2_5_omni_thinker_only"),
    ({"model_type": "qwen2_5_omni_thinker", "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"]}, {},
     "qwen2_5_omni_thinker_only"),
])
def test_variant_choice(hf, kwargs, expected):
    assert pipeline_for_model(hf, **kwargs).name == expected


def test_output_modalities_and_gpu_count_pick_the_bundled_variant(monkeypatch):
    assert load_pipeline_config(model=OMNI, output_modalities=["text"]).num_stages == 1
    assert load_pipeline_config(model=OMNI, output_modalities=["text", "audio"]).num_stages == 3
    assert load_pipeline_config(model=OMNI, output_modalities=["audio"]).num_stages == 3
    # A file is taken as given.
    assert load_pipeline_config(STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml", output_modalities=["text"]).num_stages == 3
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 1)
    one_gpu = load_pipeline_config(model=OMNI, platform="cuda")
    assert one_gpu.pipeline_name == "qwen2_5_omni_single_gpu"
    assert [s.runtime.devices for s in one_gpu.stages] == ["0", "0", "0"]
