"""GPUDiffusionWorker: the engine a diffusion stage config builds (native, dummy weights, TeaCache,
VAE slicing/tiling, the diffusers adapter with its load/call kwargs)."""
from __future__ import annotations

import torch

from tests.diffusion.conftest import BATCH_TOLERANCE, Case, image_of, run_engine
from vllm_omni.config import load_pipeline_config
from vllm_omni.diffusion.diffusers_engine import DiffusersPipelineEngine
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.stage_io import StageInfo
from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker


def _engine(model_dir, **cli):
    stage = load_pipeline_config(model=model_dir, cli_args=cli, platform="cpu").stage(0)
    return GPUDiffusionWorker(stage, str(model_dir), device="cpu").build_engine()


def _case(rid="w", steps=2, size=32, **extra) -> Case:
    return Case(rid, "a red fox", params=dict(height=size, width=size, num_inference_steps=steps, seed=4, **extra))


def test_native_engine_from_the_bundled_config(qwen_image_dir, t2i_pipe):
    engine = _engine(qwen_image_dir, cache_backend="tea_cache", max_generated_image_size=64 * 64)
    assert isinstance(engine, DiffusionEngine)
    info = engine.describe()
    assert (info.engine, info.details["pipeline"], info.details["tea_cache"], info.max_batch_size) == (
        "diffusion", "QwenImagePipeline", True, 4)
    case = _case()
    assert (image_of(run_engine(engine, [case])["w"]) - case.reference(t2i_pipe)).abs().max() <= 1e-3
    too_big = run_engine(engine, [_case("big", size=80)])["big"]
    assert "over max_generated_image_size=4096" in too_big.error


def test_vae_tiling_gives_nearly_the_same_images(qwen_image_dir, t2i_model):
    """Tiling starts above 256 pixels: a 272 x 272 image is decoded in overlapping tiles."""
    case = _case("big", steps=2, size=272)
    engine = _engine(qwen_image_dir, vae_use_tiling=True)
    assert engine.model.c.vae.use_tiling
    tiled = image_of(run_engine(engine, [case])["big"])
    plain = image_of(run_engine(DiffusionEngine(t2i_model, stage_id=0, max_batch_size=1), [case])["big"])
    assert tiled.shape == (1, 3, 272, 272)
    # Tiles blend at their seams (diffusers' tiled decode): close to, not equal to, one pass.
    assert (tiled - plain).abs().mean() < 0.01 and (tiled - plain).abs().max() > 0


def test_vae_slicing_decodes_one_image_at_a_time(qwen_image_dir, t2i_model):
    case = _case("n", steps=2, num_outputs_per_prompt=3)
    engine = _engine(qwen_image_dir, vae_use_slicing=True)
    assert engine.model.c.vae.use_slicing
    sliced = image_of(run_engine(engine, [case])["n"])
    whole = image_of(run_engine(DiffusionEngine(t2i_model, stage_id=0, max_batch_size=1), [case])["n"])
    assert sliced.shape == (3, 3, 32, 32) and (sliced - whole).abs().max() <= BATCH_TOLERANCE


def test_dummy_weights_are_random_but_of_the_real_shapes(qwen_image_dir, t2i_model):
    engine = _engine(qwen_image_dir, load_format="dummy")
    loaded = dict(t2i_model.c.transformer.named_parameters())
    dummy = dict(engine.model.c.transformer.named_parameters())
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in loaded.items()}
    assert not torch.equal(dummy["proj_out.weight"], loaded["proj_out.weight"])
    assert image_of(run_engine(engine, [_case()])["w"]).shape == (1, 3, 32, 32)


def test_the_diffusers_adapter_runs_the_pipeline_whole(qwen_image_dir, t2i_pipe):
    engine = _engine(qwen_image_dir, diffusion_load_format="diffusers", diffusers_call_kwargs={"num_inference_steps": 3},
                     diffusers_load_kwargs={"dtype": torch.float32})
    assert isinstance(engine, DiffusersPipelineEngine)
    assert engine.describe() == StageInfo(engine="diffusers", device="cpu", details={"pipeline": "QwenImagePipeline"})
    # The stage default (50 steps) does not override the call kwargs' 3; a request's own step count does.
    defaults = Case("d", "a red fox", params=dict(height=32, width=32, seed=4))
    own = Case("o", "a red fox", negative="blurry", params=dict(height=32, width=32, num_inference_steps=2, seed=4))
    out = run_engine(engine, [defaults, own])
    three_steps = Case("r", "a red fox", params=dict(height=32, width=32, num_inference_steps=3, seed=4))
    assert torch.equal(image_of(out["d"]), three_steps.reference(t2i_pipe))
    assert (image_of(out["o"]) - own.reference(t2i_pipe)).abs().max() <= BATCH_TOLERANCE
    engine.add_request(Case("a", "x", params=dict(height=32, width=32)).request())
    engine.abort(["a"])  # not started yet: gone
    assert not engine.has_work()
