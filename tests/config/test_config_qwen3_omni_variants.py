"""The bundled Qwen3-Omni configs: two GPUs by default (thinker on "0", talker and code2wav on
"1"), a single-GPU variant, a thinker-only variant, their legacy and deploy files agreeing, and
when each is chosen (the Qwen2.5-Omni rules)."""
from __future__ import annotations

import pytest

from vllm_omni.config import load_pipeline_config, pipeline_for_model
from vllm_omni.config.bundled import DEPLOY_DIR, STAGE_CONFIGS_DIR
from vllm_omni.engine.stage_input import resolve_input_processor

QWEN3 = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"]}
THINKER_ONLY = {"model_type": "qwen3_omni_moe_thinker",
                "architectures": ["Qwen3OmniMoeThinkerForConditionalGeneration"]}
BRIDGES = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"


@pytest.fixture(autouse=True)
def eight_gpus(monkeypatch):
    # The bundled choice depends on the visible GPU count; pin it so the test means the same anywhere.
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 8)


def stage_settings(pipeline) -> list[tuple]:
    """What decides how each stage runs, in comparable form (batch: what the engine gets)."""
    return [(s.stage_id, s.model_stage, s.worker_type, s.engine_input_source, s.final_output, s.final_output_type,
             s.engine_args.engine_output_type, s.runtime.devices, s.engine_args.gpu_memory_utilization,
             vars(s.default_sampling_params))
            for s in pipeline.stages]


def test_default_is_two_gpus_with_transformers_talker_defaults():
    legacy = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml", platform="cuda")
    deploy = load_pipeline_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", platform="cuda")
    default = load_pipeline_config(model=QWEN3, platform="cuda")  # what Omni(model=...) loads
    assert default.pipeline_name == "qwen3_omni_moe"
    assert stage_settings(deploy) == stage_settings(legacy) == stage_settings(default)
    thinker, talker, code2wav = default.stages
    assert [s.runtime.devices for s in default.stages] == ["0", "1", "1"]
    assert [s.engine_args.engine_output_type.value for s in default.stages] == ["latent", "token_ids", "audio"]
    assert [s.worker_type.value for s in default.stages] == ["ar", "ar", "generation"]
    assert not talker.final_output and [s.final_output_type.value for s in default.final_stages] == ["text", "audio"]
    sp = talker.default_sampling_params  # transformers' talker defaults, stop at codec EOS
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (0.9, 50, 1.0, 1.05)
    assert sp.stop_token_ids == [2150] and sp.detokenize is False
    assert [resolve_input_processor(s)[1] for s in (talker, code2wav)] == [
        f"{BRIDGES}.thinker2talker", f"{BRIDGES}.talker2code2wav"]


@pytest.mark.parametrize("platform", ["cuda", "rocm", "npu", "xpu"])
def test_single_gpu_variant(platform):
    legacy = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe_single_gpu.yaml", platform=platform)
    deploy = load_pipeline_config(DEPLOY_DIR / "qwen3_omni_moe_single_gpu.yaml", platform=platform)
    for p in (legacy, deploy):
        assert [s.runtime.devices for s in p.stages] == ["0", "0", "0"]
        assert [s.engine_args.tensor_parallel_size for s in p.stages] == [1, 1, 1]
        assert sum(s.engine_args.gpu_memory_utilization for s in p.stages) < 1
    if platform == "cuda":  # other platforms keep their own eager/cudagraph choices
        assert stage_settings(deploy) == stage_settings(legacy)
    full = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml")
    drop = lambda p: [t[:7] + t[9:] for t in stage_settings(p)]  # noqa: E731 - all but devices, memory
    assert drop(legacy) == drop(full)


def test_thinker_only_variant():
    p = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe_thinker_only.yaml")
    [thinker] = p.stages
    assert thinker.model_stage == "thinker" and thinker.final_output and thinker.final_output_type.value == "text"
    assert thinker.engine_args.engine_output_type.value == "text"  # no hidden states for a talker
    full = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml")
    assert vars(thinker.default_sampling_params) == vars(full.stages[0].default_sampling_params)


@pytest.mark.parametrize("hf, kwargs, expected", [
    (QWEN3, {}, "qwen3_omni_moe"),
    (QWEN3, {"audio_output": True, "num_devices": 2}, "qwen3_omni_moe"),
    (QWEN3, {"num_devices": 1}, "qwen3_omni_moe_single_gpu"),
    (QWEN3, {"audio_output": False}, "qwen3_omni_moe_thinker_only"),
    (QWEN3, {"audio_output": False, "num_devices": 1}, "qwen3_omni_moe_thinker_only"),
    ({**QWEN3, "enable_audio_output": False}, {}, "qwen3_omni_moe_thinker_only"),
    (THINKER_ONLY, {}, "qwen3_omni_moe_thinker_only"),
    ({"architectures": ["Qwen3OmniMoeThinkerForConditionalGeneration"]}, {"num_devices": 1},
     "qwen3_omni_moe_thinker_only"),
])
def test_variant_choice(hf, kwargs, expected):
    assert pipeline_for_model(hf, **kwargs).name == expected


def test_output_modalities_and_gpu_count_pick_the_bundled_variant(monkeypatch):
    assert load_pipeline_config(model=QWEN3, output_modalities=["text"]).num_stages == 1
    assert load_pipeline_config(model=QWEN3, output_modalities=["text", "audio"]).num_stages == 3
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 1)
    one_gpu = load_pipeline_config(model=QWEN3, platform="cuda")
    assert one_gpu.pipeline_name == "qwen3_omni_moe_single_gpu"
    assert [s.runtime.devices for s in one_gpu.stages] == ["0", "0", "0"]
    # Named in a deploy file's `pipeline:` like any bundled pipeline.
    assert load_pipeline_config(DEPLOY_DIR / "qwen3_omni_moe_single_gpu.yaml").pipeline_name == \
        "qwen3_omni_moe_single_gpu"
