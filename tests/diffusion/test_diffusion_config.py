"""Diffusion stages in the configs: stage_type / worker_type in both formats, the bundled Qwen-Image
pipeline found from a diffusers folder, diffusion settings from YAML, flags and overrides."""
from __future__ import annotations

import argparse
import json
import textwrap

import pytest

from vllm_omni.config import ConfigError, ConfigFormat, WorkerType, load_pipeline_config, read_hf_config
from vllm_omni.config.resolve import DIFFUSION_WORKER
from vllm_omni.entrypoints.cli import serve_args
from vllm_omni.sampling_params import DiffusionSamplingParams

QWEN_IMAGE = {"architectures": ["QwenImagePipeline"]}
LEGACY = """\
stage_args:
  - stage_id: 0
    {kind}
    engine_args: {{model_stage: diffusion{engine}}}
    final_output_type: image
    default_sampling_params: {{num_inference_steps: 8, height: 64}}
"""


def _legacy(tmp_path, kind: str = "stage_type: diffusion", engine: str = ""):
    path = tmp_path / "stages.yaml"
    path.write_text(LEGACY.format(kind=kind, engine=engine))
    return path


@pytest.mark.parametrize("kind", ["stage_type: diffusion", "engine_args: {worker_type: diffusion}"])
def test_legacy_stage_type_or_worker_type_makes_a_diffusion_stage(tmp_path, kind):
    path = tmp_path / "stages.yaml"
    if kind.startswith("engine_args"):
        path.write_text(LEGACY.format(kind="", engine=", worker_type: diffusion"))
    else:
        path.write_text(LEGACY.format(kind=kind, engine=""))
    stage = load_pipeline_config(path).stage(0)
    assert stage.worker_type == WorkerType.DIFFUSION
    assert stage.engine_args.worker_cls == DIFFUSION_WORKER
    assert stage.default_sampling_params == DiffusionSamplingParams(num_inference_steps=8, height=64)


def test_contradicting_stage_types_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="stage_type 'diffusion' .* contradicts worker_type"):
        load_pipeline_config(_legacy(tmp_path, engine=", worker_type: ar"))
    with pytest.raises(ConfigError, match="contradicts stage_type 'llm'"):
        load_pipeline_config(_legacy(tmp_path, kind="stage_type: llm", engine=", worker_type: diffusion"))


def test_text_sampling_fields_on_a_diffusion_stage_are_errors(tmp_path):
    path = tmp_path / "stages.yaml"
    path.write_text(LEGACY.format(kind="stage_type: diffusion", engine="").replace("height: 64", "temperature: 0.5"))
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['temperature'\]"):
        load_pipeline_config(path)
    with pytest.raises(ConfigError, match="num_inference_steps"):
        load_pipeline_config(path.parent / "stages.yaml", stage_overrides={"0": {
            "default_sampling_params": {"num_inference_steps": 0}}})


def test_a_diffusers_folder_finds_the_bundled_qwen_image_pipeline(qwen_image_edit_dir):
    assert read_hf_config(qwen_image_edit_dir)["architectures"] == ["QwenImageEditPipeline"]
    p = load_pipeline_config(model=qwen_image_edit_dir, platform="cuda")
    assert p.format is ConfigFormat.DEPLOY and p.pipeline_name == "qwen_image"
    stage = p.stage(0)
    assert stage.worker_type == WorkerType.DIFFUSION and stage.final_output_type.value == "image"
    assert stage.engine_args.dtype == "bfloat16" and stage.runtime.max_batch_size == 4
    assert load_pipeline_config(model=qwen_image_edit_dir, platform="cpu").stage(0).engine_args.dtype == "float32"


def test_deploy_files_may_name_the_stage_type(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent("""\
        pipeline: qwen_image
        stages:
          - stage_id: 0
            stage_type: diffusion
            cache_backend: tea_cache
            cache_config: {rel_l1_thresh: 0.3}
            cfg_parallel_size: 2
            devices: "0,1"
            max_generated_image_size: 1048576
    """))
    ea = load_pipeline_config(path, platform="cuda").stage(0).engine_args
    assert (ea.cache_backend, dict(ea.cache_config), ea.cfg_parallel_size) == ("tea_cache", {"rel_l1_thresh": 0.3}, 2)
    assert ea.max_generated_image_size == 1048576
    path.write_text(path.read_text().replace('devices: "0,1"', 'devices: "0"'))
    with pytest.raises(ConfigError, match=r"lists 1 device\(s\) but .* cfg_parallel_size=2"):
        load_pipeline_config(path, platform="cuda")


def _serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    return parser.parse_args(["model", *argv])


def test_serve_flags_reach_the_diffusion_stage():
    args = _serve(["--cache-backend", "tea_cache", "--cache-config", '{"rel_l1_thresh": 0.25}', "--vae-use-slicing",
                   "--vae-use-tiling", "--enable-cpu-offload", "--max-generated-image-size", "4096",
                   "--diffusion-load-format", "diffusers", "--diffusers-call-kwargs", '{"num_inference_steps": 3}',
                   "--model-class-name", "QwenImagePipeline", "--step-execution",
                   "--default-sampling-params", '{"0": {"num_inference_steps": 7, "height": 32}}',
                   "--stage-overrides", '{"0": {"default_sampling_params": {"height": 48}}}'])
    assert serve_args.refused_flags(args) == []
    p = load_pipeline_config(model=QWEN_IMAGE, cli_args=serve_args.engine_args(args),
                             stage_overrides=serve_args.stage_overrides(args), platform="cpu")
    ea = p.stage(0).engine_args
    assert (ea.cache_backend, dict(ea.cache_config), ea.vae_use_slicing, ea.vae_use_tiling) == (
        "tea_cache", {"rel_l1_thresh": 0.25}, True, True)
    assert (ea.enable_cpu_offload, ea.max_generated_image_size, ea.diffusion_load_format) == (True, 4096, "diffusers")
    assert dict(ea.diffusers_call_kwargs) == {"num_inference_steps": 3} and ea.model_class_name == "QwenImagePipeline"
    # --default-sampling-params under --stage-overrides, field by field.
    assert p.stage(0).default_sampling_params == DiffusionSamplingParams(num_inference_steps=7, height=48,
                                                                         true_cfg_scale=4.0)


def test_unimplemented_diffusion_flags_are_refused_by_name():
    args = _serve(["--no-guardrails", "--cache-backend", "tea_cache"])
    assert [m.split("=")[0] for m in serve_args.refused_flags(args)] == ["--no-guardrails"]
    with pytest.raises(ConfigError, match="allowed: 'none' | 'tea_cache' | 'cache_dit'"):
        load_pipeline_config(model=QWEN_IMAGE, cli_args={"cache_backend": "mag_cache"}, platform="cpu")
    with pytest.raises(ConfigError, match="'default' | 'dummy' | 'diffusers'"):
        load_pipeline_config(model=QWEN_IMAGE, cli_args={"diffusion_load_format": "custom_pipeline"}, platform="cpu")
    with pytest.raises(ConfigError, match="rel_l1_thresh"):
        load_pipeline_config(model=QWEN_IMAGE, cli_args={"cache_config": {"rel_l1_thresh": -1}}, platform="cpu")


def test_diffusion_flags_on_a_pipeline_without_a_diffusion_stage_are_errors():
    with pytest.raises(ConfigError, match="engine_args.cache_backend.*a diffusion setting and this pipeline has no "
                                          "diffusion stage"):
        load_pipeline_config(model={"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
                             cli_args={"cache_backend": "tea_cache"}, platform="cpu")


def test_check_config_prints_a_diffusion_pipeline(qwen_image_dir, capsys):
    from vllm_omni.entrypoints.cli.main import main

    assert main(["check-config", "--model", str(qwen_image_dir), "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    assert stage["engine_args"]["worker_type"] == "diffusion"
    assert stage["default_sampling_params"]["num_inference_steps"] == 50


def test_step_execution_false_is_named_in_the_warning():
    """The engine always steps: step_execution true is what it does, false cannot be honoured."""
    stepped = load_pipeline_config(model=QWEN_IMAGE, cli_args={"step_execution": True}, platform="cpu")
    assert stepped.ignored == ()
    whole = load_pipeline_config(model=QWEN_IMAGE, cli_args={"step_execution": False}, platform="cpu")
    assert [(i.field, i.stages) for i in whole.ignored] == [("engine_args.step_execution", (0,))]
