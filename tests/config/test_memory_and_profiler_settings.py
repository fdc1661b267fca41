"""Issue 46's memory, loading and profiling settings in the configs: the serve flags reach the stages
they apply to, the stage keys are read from YAML and --stage-overrides, and what does not combine
is refused naming the stage and the field."""
from __future__ import annotations

import argparse

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.entrypoints.cli import serve_args

QWEN_IMAGE = {"architectures": ["QwenImagePipeline"]}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
OMNI_YAML = """\
stage_args:
  - stage_id: 0
    engine_args: {model_stage: thinker, model_arch: Qwen2_5OmniForConditionalGeneration, worker_type: ar,
                  enable_sleep_mode: true, enable_ar_profiler: true, num_weight_load_threads: 8}
    final_output_type: text
"""


def _serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    return parser.parse_args(["model", *argv])


def test_the_flags_are_implemented_and_reach_their_stages():
    args = _serve(["--enable-sleep-mode", "--enable-ar-profiler", "--num-weight-load-threads", "8",
                   "--disable-multithread-weight-load"])
    assert serve_args.refused_flags(args) == []
    assert serve_args.engine_args(args) == {"enable_sleep_mode": True, "enable_ar_profiler": True,
                                            "num_weight_load_threads": 8, "enable_multithread_weight_load": False}
    ea = load_pipeline_config(model=QWEN3, cli_args=serve_args.engine_args(args), platform="cpu").stage(0).engine_args
    assert (ea.enable_sleep_mode, ea.enable_ar_profiler, ea.num_weight_load_threads) == (True, True, 8)
    assert ea.weight_load_threads == 1  # --disable-multithread-weight-load: one thread
    diffusion = _serve(["--enable-layerwise-offload", "--enable-diffusion-pipeline-profiler"])
    assert serve_args.refused_flags(diffusion) == []
    ea = load_pipeline_config(model=QWEN_IMAGE, cli_args=serve_args.engine_args(diffusion),
                              platform="cpu").stage(0).engine_args
    assert ea.enable_layerwise_offload and ea.enable_diffusion_pipeline_profiler
    defaults = load_pipeline_config(model=QWEN3, platform="cpu").stage(0).engine_args
    assert (defaults.enable_sleep_mode, defaults.enable_ar_profiler, defaults.weight_load_threads) == (False, False, 4)


def test_the_stage_keys_are_read_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "stages.yaml"
    path.write_text(OMNI_YAML)
    ea = load_pipeline_config(path, stage_overrides={"0": {"enable_multithread_weight_load": False}}).stage(0).engine_args
    assert (ea.enable_sleep_mode, ea.enable_ar_profiler, ea.num_weight_load_threads) == (True, True, 8)
    assert ea.weight_load_threads == 1
    with pytest.raises(ConfigError, match="num_weight_load_threads.*an integer >= 1"):
        load_pipeline_config(path, stage_overrides={"0": {"num_weight_load_threads": 0}})


@pytest.mark.parametrize("model, settings, field", [
    (QWEN3, {"tensor_parallel_size": 2}, "engine_args.tensor_parallel_size"),
    (QWEN_IMAGE, {"diffusion_load_format": "diffusers"}, "engine_args.diffusion_load_format"),
    (QWEN_IMAGE, {"enable_layerwise_offload": True}, "engine_args.enable_layerwise_offload"),
])
def test_what_sleep_mode_cannot_rebuild_is_refused(model, settings, field):
    with pytest.raises(ConfigError, match=f"stage 0.*{field}.*does not combine with enable_sleep_mode"):
        load_pipeline_config(model=model, cli_args={"enable_sleep_mode": True, **settings}, platform="cpu",
                             stage_overrides={"0": {"runtime": {"devices": "0,1"}}} if "tensor" in field else None)


def test_ar_settings_need_an_ar_stage():
    with pytest.raises(ConfigError, match="engine_args.enable_ar_profiler.*an AR setting and this pipeline has no "
                                          "AR stage"):
        load_pipeline_config(model=QWEN_IMAGE, cli_args={"enable_ar_profiler": True}, platform="cpu")
    with pytest.raises(ConfigError, match="num_weight_load_threads.*no AR stage"):
        load_pipeline_config(model=QWEN_IMAGE, cli_args={"num_weight_load_threads": 8}, platform="cpu")


def test_layerwise_offload_of_a_gguf_transformer_is_refused():
    gguf = {"method": "gguf", "gguf_model": "/models/transformer.gguf"}
    with pytest.raises(ConfigError, match="engine_args.enable_layerwise_offload.*GGUF"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
            "enable_layerwise_offload": True, "diffusion_quantization_config": gguf})
    fp8 = load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
        "enable_layerwise_offload": True, "diffusion_quantization_config": {"method": "fp8"}}).stage(0).engine_args
    assert fp8.enable_layerwise_offload and fp8.diffusion_quantization_config.method == "fp8"
