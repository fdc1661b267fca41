"""The Qwen-Image stage's compiled transformer on the GPU against the eager diffusers blocks.

The tiny checkpoint, float32 (TF32 off) and bfloat16: a step's velocities of a padded CFG batch
(prompts of different lengths) and of a row subset, and whole images from the engine with
TeaCache, compiled vs eager. Tolerances: float32 differs only by kernel rounding; bfloat16
compounds one bf16 rounding per block difference over the tiny model's layers.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.diffusion.denoise import Denoiser  # noqa: E402
from vllm_omni.diffusion.engine import DiffusionEngine  # noqa: E402
from vllm_omni.diffusion.request import DiffusionRequest  # noqa: E402
from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig  # noqa: E402
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration  # noqa: E402
from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel  # noqa: E402
from vllm_omni.sampling_params import DiffusionSamplingParams  # noqa: E402
from vllm_omni.stage_io import StageRequest  # noqa: E402

CUDA = torch.device("cuda")
VELOCITY_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}
IMAGE_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.05}
PROMPTS = [("a red fox in the snow, photograph", " "), ("two apples", "blurry, low quality, watermark")]


def _request(i: int, prompt: str, negative: str, size: int = 64) -> StageRequest:
    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=6, true_cfg_scale=4.0, seed=i)
    return StageRequest(request_id=str(i), prompt_token_ids=[], prompt=prompt, sampling_params=params,
                        additional_information={"negative_prompt": negative})


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def models(request, tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tiny_model("qwen_image")
    eager = QwenImageModel.load(folder, device=CUDA, dtype=request.param)
    compiled = QwenImageModel(eager.c, device=CUDA, acceleration=DenoiserAcceleration(compile=True))
    assert compiled.compiled and not eager.compiled
    return request.param, eager, compiled


def test_a_step_matches_the_eager_blocks(models):
    dtype, eager, compiled = models
    requests = []
    for i, (prompt, negative) in enumerate(PROMPTS):
        r = _request(i, prompt, negative)
        requests.append(DiffusionRequest(r, r.sampling_params))
        requests[-1].start(eager.prepare(r, r.sampling_params))
    with torch.inference_mode():
        expected = Denoiser(eager).velocities(requests)
        got = Denoiser(compiled).velocities(requests)
        rows = torch.tensor([1, 2], device=CUDA)  # TeaCache's subset path: mixed lengths, mixed branches
        emb = eager.embed(eager.make_batch([_group(r, u) for u in (False, True) for r in requests]))
        sub_expected, sub_got = eager.run_blocks(emb, rows), compiled.run_blocks(emb, rows)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g.float(), e.float(), atol=VELOCITY_ATOL[dtype], rtol=0)
    torch.testing.assert_close(sub_got.float(), sub_expected.float(), atol=VELOCITY_ATOL[dtype], rtol=0)


def test_images_match(models):
    dtype, eager, compiled = models
    images = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        # TeaCache in float32 only: in bfloat16 a distance near the threshold may decide differently.
        cache = TeaCache(TeaCacheConfig(rel_l1_thresh=0.2)) if dtype == torch.float32 else None
        engine = DiffusionEngine(model, stage_id=0, max_batch_size=4, device="cuda", cache=cache)
        for i, (prompt, negative) in enumerate(PROMPTS):
            engine.add_request(_request(i, prompt, negative))
        outs = {}
        while engine.has_work():
            for out in engine.step():
                assert out.error is None, out.error
                outs[out.request_id] = out.multimodal_output["image"]
        images[name] = outs
    for rid in images["eager"]:
        torch.testing.assert_close(images["compiled"][rid], images["eager"][rid], atol=IMAGE_ATOL[dtype], rtol=0)


def _group(request: DiffusionRequest, uncond: bool):
    from vllm_omni.model_executor.models.diffusion_model import RowGroup

    return RowGroup(request.prepared, request.latents, request.timestep(), uncond)
