"""Every family's bundled pipelines (its record's `pipelines`): the legacy and deploy files agree,
the single-device and text-only variants are what they say, and each is chosen when it should be.
What is particular to one family follows at the end."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni.config import load_pipeline_config, pipeline_for_model
from vllm_omni.config.bundled import DEPLOY_DIR, STAGE_CONFIGS_DIR
from vllm_omni.engine.stage_input import resolve_input_processor
from vllm_omni.model_executor.models.families import FAMILIES, family_by_name
from vllm_omni.model_executor.models.family import ModelFamily, PipelineVariant

DEFAULT, SINGLE, TEXT = PipelineVariant.DEFAULT, PipelineVariant.SINGLE_DEVICE, PipelineVariant.TEXT_ONLY
OMNI_FAMILIES = [f for f in FAMILIES if {DEFAULT, SINGLE, TEXT} <= set(f.pipelines)]
by_family = pytest.mark.parametrize("family", OMNI_FAMILIES, ids=[f.name for f in OMNI_FAMILIES])


def hf_config(family: ModelFamily, **extra) -> dict:
    return {"model_type": family.model_types[0], "architectures": [family.architectures[0]], **extra}


def legacy(family: ModelFamily, variant: PipelineVariant, **kw):
    return load_pipeline_config(STAGE_CONFIGS_DIR / f"{family.pipelines[variant]}.yaml", **kw)


@pytest.fixture(autouse=True)
def eight_gpus(monkeypatch):
    # The bundled choice depends on the visible GPU count; pin it so the test means the same anywhere.
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 8)


def stage_settings(pipeline) -> list[tuple]:
    """What decides how each stage runs, in comparable form."""
    return [(s.stage_id, s.model_stage, s.worker_type, s.engine_input_source, s.final_output, s.final_output_type,
             s.engine_args.engine_output_type, s.runtime.devices, s.engine_args.gpu_memory_utilization,
             vars(s.default_sampling_params))
            for s in pipeline.stages]


@by_family
def test_deploy_file_and_model_lookup_agree_with_the_legacy_file(family):
    old = legacy(family, DEFAULT, platform="cuda")
    deploy = load_pipeline_config(DEPLOY_DIR / f"{family.pipelines[DEFAULT]}.yaml", platform="cuda")
    default = load_pipeline_config(model=hf_config(family), platform="cuda")  # what Omni(model=...) loads
    assert default.pipeline_name == family.pipelines[DEFAULT]
    assert stage_settings(deploy) == stage_settings(old) == stage_settings(default)
    # Stages without a custom_process_input_func get the family's own bridges.
    stages = {s.model_stage: s for s in old.stages}
    for stage_name, bridge in family.bridges.items():
        assert resolve_input_processor(stages[stage_name])[1] == bridge


@by_family
@pytest.mark.parametrize("platform", ["cuda", "rocm", "npu", "xpu"])
def test_single_device_variant(family, platform):
    old = legacy(family, SINGLE, platform=platform)
    deploy = load_pipeline_config(DEPLOY_DIR / f"{family.pipelines[SINGLE]}.yaml", platform=platform)
    for p in (old, deploy):
        assert {s.runtime.devices for s in p.stages} == {"0"}
        assert {s.engine_args.tensor_parallel_size for s in p.stages} == {1}
        assert sum(s.engine_args.gpu_memory_utilization for s in p.stages) < 1
    if platform == "cuda":  # other platforms keep their own eager/cudagraph choices
        assert stage_settings(deploy) == stage_settings(old)
    drop = lambda p: [t[:7] + t[9:] for t in stage_settings(p)]  # noqa: E731 - all but devices, memory
    assert drop(old) == drop(legacy(family, DEFAULT))


@by_family
def test_text_only_variant(family):
    [thinker] = legacy(family, TEXT).stages
    assert thinker.final_output and thinker.final_output_type.value == "text"
    assert thinker.engine_args.engine_output_type.value == "text"  # no hidden states for a talker
    full = legacy(family, DEFAULT)
    assert thinker.model_stage == full.stages[0].model_stage
    assert vars(thinker.default_sampling_params) == vars(full.stages[0].default_sampling_params)


@by_family
def test_variant_choice(family):
    names = family.pipelines
    omni = hf_config(family)
    assert pipeline_for_model(omni).name == names[DEFAULT]
    assert pipeline_for_model(omni, audio_output=True, num_devices=8).name == names[DEFAULT]
    assert pipeline_for_model(omni, num_devices=1).name == names[SINGLE]
    assert pipeline_for_model(omni, audio_output=False).name == names[TEXT]
    assert pipeline_for_model(omni, audio_output=False, num_devices=1).name == names[TEXT]
    assert pipeline_for_model(hf_config(family, enable_audio_output=False)).name == names[TEXT]
    for key in family.stage_checkpoints:  # a thinker saved alone, by architecture or model_type
        assert pipeline_for_model({"architectures": [key]} if key[0].isupper() else {"model_type": key},
                                  num_devices=1).name == names[TEXT]


@by_family
def test_output_modalities_and_gpu_count_pick_the_bundled_variant(family, monkeypatch):
    omni = hf_config(family)
    assert load_pipeline_config(model=omni, output_modalities=["text"]).num_stages == 1
    assert load_pipeline_config(model=omni, output_modalities=["text", "audio"]).num_stages == 3
    assert load_pipeline_config(model=omni, output_modalities=["audio"]).num_stages == 3
    # A file is taken as given.
    assert legacy(family, DEFAULT, output_modalities=["text"]).num_stages == 3
    # Named in a deploy file's `pipeline:` like any bundled pipeline.
    assert load_pipeline_config(DEPLOY_DIR / f"{family.pipelines[SINGLE]}.yaml").pipeline_name == \
        family.pipelines[SINGLE]
    monkeypatch.setattr("vllm_omni.config.loader.visible_device_count", lambda platform: 1)
    one_gpu = load_pipeline_config(model=omni, platform="cuda")
    assert one_gpu.pipeline_name == family.pipelines[SINGLE]
    assert {s.runtime.devices for s in one_gpu.stages} == {"0"}


# --- Qwen2.5-Omni ---------------------------------------------------------------------------------

def test_qwen2_5_omni_spec_yaml_is_bundled_verbatim():
    spec = Path(__file__).parent / "data" / "spec000_qwen2_5_omni.yaml"  # copied from spec 000
    assert (STAGE_CONFIGS_DIR / "qwen2_5_omni.yaml").read_text() == spec.read_text()
    p = legacy(family_by_name("qwen2_5_omni"), DEFAULT)
    assert [e.window_size for e in p.edges] == [-1, -1]


# --- Qwen3-Omni -----------------------------------------------------------------------------------

def test_qwen3_omni_default_is_two_gpus_with_transformers_talker_defaults():
    default = load_pipeline_config(model=hf_config(family_by_name("qwen3_omni_moe")), platform="cuda")
    thinker, talker, code2wav = default.stages
    assert [s.runtime.devices for s in default.stages] == ["0", "1", "1"]
    assert [s.engine_args.engine_output_type.value for s in default.stages] == ["latent", "token_ids", "audio"]
    assert [s.worker_type.value for s in default.stages] == ["ar", "ar", "generation"]
    assert not talker.final_output and [s.final_output_type.value for s in default.final_stages] == ["text", "audio"]
    sp = talker.default_sampling_params  # transformers' talker defaults, stop at codec EOS
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (0.9, 50, 1.0, 1.05)
    assert sp.stop_token_ids == [2150] and sp.detokenize is False
