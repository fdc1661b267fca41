"""Wan's fast path: CompilableWanBlock (run uncompiled here, on the CPU in float32) against
diffusers' blocks, and the per-frame timestep embedding of TI2V-5B against diffusers' per-token
one. tests/gpu/test_wan_compiled.py compares the compiled model with diffusers on CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.diffusion.conftest import WAN_SIZES, WanCase, random_image
from vllm_omni.diffusion.model import RowGroup
from vllm_omni.model_executor.models.wan2_2 import denoiser
from vllm_omni.model_executor.models.wan2_2.block import CompilableWanBlock

# float32: the fused GELU (tanh form, inside addmm) and the float32 RoPE (diffusers': float64
# tables) round differently in the last bits.
TOLERANCE = 1e-4


def _batch(model, layout: str, step: int):
    """Two requests' conditional and unconditional rows at one step; with TI2V-5B one starts from an image."""
    cases = [WanCase("a", "a red fox", "blurry", params=dict(WAN_SIZES[layout], num_frames=9, seed=1)),
             WanCase("b", "two apples", image=random_image(40, 40) if layout == "ti2v" else None,
                     params=dict(WAN_SIZES[layout], num_frames=9, seed=2))]
    prepared = [model.prepare(c.request(), c.request().sampling_params) for c in cases]
    groups = [RowGroup(p, p.latents, p.timesteps[step], uncond, p.experts[step])
              for uncond in (False, True) for p in prepared if p.do_cfg or not uncond]
    return model.make_batch(groups)


@pytest.mark.parametrize("layout,step", [("a14b", 0), ("a14b", 45), ("ti2v", 1)])  # 45: the low-noise expert
def test_compilable_blocks_and_per_frame_timesteps_equal_diffusers(wan_model, layout, step):
    model = wan_model(layout)
    batch = _batch(model, layout, step)
    transformer = model.experts[batch.expert]
    reference = denoiser.embed(transformer, batch, per_frame=False)
    fast = denoiser.embed(transformer, batch, per_frame=True)
    if layout == "ti2v":  # one timestep per token in diffusers, per latent frame here
        assert reference.timestep_proj.shape[1] == reference.hidden.shape[1]
        assert fast.timestep_proj.shape[1] == reference.grid[0]
    wrapped = [CompilableWanBlock(block) for block in transformer.blocks]
    expected = denoiser.run_blocks(transformer.blocks, reference, compiled=False)
    got = denoiser.run_blocks(wrapped, fast, compiled=True)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    with torch.no_grad():
        diffusers_out = transformer(hidden_states=batch.hidden_states, timestep=batch.timestep,
                                    encoder_hidden_states=batch.encoder_hidden_states, return_dict=False)[0]
    assert torch.equal(denoiser.finish(transformer, reference, expected), diffusers_out)
    torch.testing.assert_close(denoiser.finish(transformer, fast, got), diffusers_out, atol=TOLERANCE, rtol=0)


def test_a_cpu_model_keeps_the_diffusers_blocks(wan_dir):
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    model = WanModel.load(wan_dir("a14b"), device=torch.device("cpu"), dtype=torch.float32,
                          acceleration=DenoiserAcceleration(compile=True))
    assert not model.compiled and all(b is t.blocks for b, t in zip(model.blocks, model.c.transformers))
