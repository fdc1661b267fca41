"""Wan2.2's compiled stage on the GPU against diffusers: a CFG step's guided velocity and whole
videos, on the tiny T2V-A14B (both experts) and TI2V-5B (per-frame timesteps, an input image).

float32 (TF32 off) differs from diffusers by kernel rounding only; bfloat16 by one bf16 rounding
per fused op over the tiny model's layers and steps (diffusers runs its two CFG branches as two
batches of one, we run one batch of two). The middle steps of the loop make no host
synchronisation. Run: `pytest -q tests/gpu/test_wan_compiled.py` (needs accelerate: diffusers
loads Wan transformers through it).
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.diffusion.conftest import WanCase, random_image  # noqa: E402
from vllm_omni.diffusion.denoise import Denoiser  # noqa: E402
from vllm_omni.diffusion.engine import DiffusionEngine  # noqa: E402
from vllm_omni.diffusion.request import DiffusionRequest  # noqa: E402
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration  # noqa: E402
from vllm_omni.model_executor.models.wan2_2.model import WanModel  # noqa: E402
from vllm_omni.testing.cuda_syncs import format_syncs, trace_syncs  # noqa: E402

CUDA = torch.device("cuda")
VELOCITY_ATOL = {torch.float32: 2e-3, torch.bfloat16: 0.1}
VIDEO_ATOL = {torch.float32: 2e-3, torch.bfloat16: 0.1}
CASES = {
    "a14b": [WanCase("t", "a red fox in the snow", "blurry",
                     params=dict(height=64, width=96, num_frames=9, num_inference_steps=4, guidance_scale=4.0,
                                 guidance_scale_2=3.0, seed=1))],
    "ti2v": [WanCase("t", "waves on a beach", params=dict(height=64, width=96, num_frames=9, num_inference_steps=3,
                                                        seed=2)),
             WanCase("i", "a boat sails away", image=random_image(80, 120, seed=3),
                     params=dict(height=64, width=96, num_frames=9, num_inference_steps=3, seed=3))],
}


@pytest.fixture(scope="module", params=[(layout, dtype) for layout in CASES for dtype in (torch.float32,
                                                                                            torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def setup(request, tiny_model):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    torch.backends.cuda.matmul.allow_tf32 = False
    layout, dtype = request.param
    folder = tiny_model("wan2_2", layout=layout)
    model = WanModel.load(folder, device=CUDA, dtype=dtype, acceleration=DenoiserAcceleration(compile=True))
    assert model.compiled
    pipes = {"t2v": WanPipeline.from_pretrained(folder, dtype=dtype).to(CUDA)}
    if layout == "ti2v":
        pipes["i2v"] = WanImageToVideoPipeline.from_pretrained(folder, dtype=dtype).to(CUDA)
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return layout, dtype, model, pipes


def test_a_guided_step_matches_diffusers(setup):
    layout, dtype, model, pipes = setup
    for case in CASES[layout]:
        r = DiffusionRequest(case.request(), case.request().sampling_params)
        r.start(model.prepare(r.request, r.params))
        for step in range(r.num_steps):
            r.step = step
            with torch.inference_mode():
                got = Denoiser(model).velocities([r])[0]
                expected = _diffusers_velocity(model, r, step)
            err = (got.float() - expected.float()).abs().max().item()
            assert err <= VELOCITY_ATOL[dtype], f"{case.request_id} step {step}: max |diff| {err}"


def test_videos_match_diffusers_and_the_loop_does_not_sync(setup):
    layout, dtype, model, pipes = setup
    engine = DiffusionEngine(model, stage_id=0, max_batch_size=4, device="cuda")
    for case in CASES[layout]:
        engine.add_request(case.request())
    outputs = {}
    for out in engine.step():  # the first step: prompts encoded, noise drawn, compiled
        outputs[out.request_id] = out
    syncs = trace_syncs(engine.step)  # a middle step: forwards and solver updates only
    assert not syncs, format_syncs(syncs)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
    for case in CASES[layout]:
        out = outputs[case.request_id]
        assert out.error is None, out.error
        err = (out.multimodal_output["video"] - case.reference(pipes).float().cpu()).abs().max().item()
        assert err <= VIDEO_ATOL[dtype], f"{case.request_id}: max |diff| {err}"


def _diffusers_velocity(model: WanModel, r: DiffusionRequest, step: int) -> torch.Tensor:
    """WanPipeline's guided prediction for this request's step: two transformer calls (cond, uncond)."""
    from vllm_omni.diffusion.model import RowGroup

    p = r.prepared
    transformer = model.c.transformers[p.experts[step]]
    batch = model.make_batch([RowGroup(p, r.latents, p.timesteps[step], False, p.experts[step])])
    cond = transformer(hidden_states=batch.hidden_states, timestep=batch.timestep, encoder_hidden_states=p.prompt,
                       return_dict=False)[0]
    if not p.do_cfg:
        return cond
    uncond = transformer(hidden_states=batch.hidden_states, timestep=batch.timestep,
                         encoder_hidden_states=p.negative, return_dict=False)[0]
    return uncond + p.cfg_scales[step] * (cond - uncond)


def test_cpu_offload_keeps_only_the_running_expert_on_the_gpu(tiny_model):
    """enable_cpu_offload: the same video, with the idle expert (and the text encoder, the VAE) on the CPU."""
    folder = tiny_model("wan2_2", layout="a14b")
    case = CASES["a14b"][0]
    videos, resident = {}, []
    for offload in (False, True):
        model = WanModel.load(folder, device=CUDA, dtype=torch.float32, cpu_offload=offload)
        engine = DiffusionEngine(model, stage_id=0, max_batch_size=1, device="cuda")
        engine.add_request(case.request())
        while engine.has_work():
            for out in engine.step():
                videos[offload] = out.multimodal_output["video"]
            if offload:
                resident.append(tuple(next(t.parameters()).device.type for t in model.c.transformers))
    assert ("cuda", "cpu") in resident and ("cpu", "cuda") in resident  # steps 0-1 on the high-noise expert, 2-3 low
    assert next(model.c.text_encoder.parameters()).device.type == "cpu"
    torch.testing.assert_close(videos[True], videos[False], atol=1e-5, rtol=0)
