"""Wan2.2 in the configs: the bundled pipeline found from a diffusers folder, --boundary-ratio and
--flow-shift (and the same stage keys) reaching the model, and what they are refused on."""
from __future__ import annotations

import argparse

import pytest
import torch

from vllm_omni.config import ConfigError, ConfigFormat, WorkerType, load_pipeline_config
from vllm_omni.entrypoints.cli import serve_args
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest

WAN = {"architectures": ["WanPipeline"]}


def _serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    return parser.parse_args(["model", *argv])


@pytest.mark.parametrize("layout,pipeline", [("a14b", "WanPipeline"), ("i2v", "WanImageToVideoPipeline")])
def test_a_wan_folder_finds_the_bundled_video_pipeline(wan_dir, layout, pipeline):
    p = load_pipeline_config(model=wan_dir(layout), platform="cuda")
    assert p.format is ConfigFormat.DEPLOY and p.pipeline_name == "wan2_2"
    stage = p.stage(0)
    assert stage.worker_type == WorkerType.DIFFUSION and stage.final_output_type.value == "video"
    assert stage.engine_args.dtype == "bfloat16" and not stage.engine_args.enforce_eager
    assert load_pipeline_config(model=wan_dir(layout), platform="cpu").stage(0).engine_args.dtype == "float32"


def test_boundary_ratio_and_flow_shift_flags_reach_the_stage():
    args = _serve(["--boundary-ratio", "0.9", "--flow-shift", "12"])
    assert serve_args.refused_flags(args) == []
    ea = load_pipeline_config(model=WAN, cli_args=serve_args.engine_args(args), platform="cpu").stage(0).engine_args
    assert (ea.boundary_ratio, ea.flow_shift) == (0.9, 12.0)
    overrides = {"0": {"engine_args": {"boundary_ratio": 0.5, "flow_shift": 3}}}
    ea = load_pipeline_config(model=WAN, stage_overrides=overrides, platform="cpu").stage(0).engine_args
    assert (ea.boundary_ratio, ea.flow_shift) == (0.5, 3.0)
    for key, bad in (("boundary_ratio", 1.5), ("flow_shift", 0)):
        with pytest.raises(ConfigError, match=key):
            load_pipeline_config(model=WAN, cli_args={key: bad}, platform="cpu")


def _experts_and_timesteps(model, steps: int = 4) -> tuple[tuple[int, ...], list[int]]:
    params = DiffusionSamplingParams(height=32, width=48, num_frames=5, num_inference_steps=steps, seed=0)
    prepared = model.prepare(StageRequest(request_id="r", prompt_token_ids=[], prompt="x", sampling_params=params),
                             params)
    return prepared.experts, prepared.timesteps.tolist()


def test_boundary_ratio_and_flow_shift_change_the_schedule(wan_dir, wan_model):
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    experts, timesteps = _experts_and_timesteps(wan_model("a14b"))
    assert (experts, timesteps) == ((0, 0, 1, 1), [999, 900, 750, 500])  # the folder's 0.875, flow_shift 3
    cpu = torch.device("cpu")
    later = WanModel.load(wan_dir("a14b"), device=cpu, dtype=torch.float32, boundary_ratio=0.95)
    assert _experts_and_timesteps(later) == ((0, 1, 1, 1), timesteps)
    shifted = WanModel.load(wan_dir("a14b"), device=cpu, dtype=torch.float32, flow_shift=12.0)
    assert _experts_and_timesteps(shifted) == ((0, 0, 0, 1), [999, 973, 923, 800])


def test_wan_settings_are_refused_where_they_mean_nothing(wan_dir, qwen_image_dir):
    from vllm_omni.diffusion.tea_cache import TeaCacheConfig
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="one transformer"):
        WanModel.load(wan_dir("ti2v"), device=cpu, dtype=torch.float32, boundary_ratio=0.5)
    with pytest.raises(ValueError, match="boundary_ratio=0.5: Qwen-Image has no such setting"):
        QwenImageModel.load(qwen_image_dir, device=cpu, dtype=torch.float32, boundary_ratio=0.5)
    with pytest.raises(ValueError, match="TeaCache does not support WanTransformer3DModel"):
        TeaCacheConfig.for_model("WanTransformer3DModel", {"coefficients": [1, 2, 3, 4, 5]})


def test_the_engine_reports_the_video_settings(wan_model):
    info = wan_model("ti2v").describe()
    assert (info["fps"], info["frame_step"], info["image_input"], info["experts"]) == (24, 4, "optional", 1)
    assert wan_model("a14b").describe()["image_input"] == "none"


def test_a_quantized_component_is_refused_by_name_when_it_loads(tmp_path):
    """Upstream's Wan2.2 FP8 / NVFP4 stage configs expect a ModelOpt checkpoint: its
    `quantization_config` is refused at load, not read as plain weights."""
    from vllm_omni.model_executor.models.diffusers_folder import refuse_quantized

    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "modelopt"}}')
    with pytest.raises(ValueError, match=r"quantized checkpoint \(quantization_config: modelopt\) is not supported"):
        refuse_quantized(tmp_path)
    (tmp_path / "config.json").write_text('{"num_layers": 2}')
    refuse_quantized(tmp_path)
