"""Tiny Wan2.2 TI2V-5B videos over 4 CPU ranks (gloo) against the one-process videos.

One world: Ulysses 2 x ring 2 (advanced_uaa: 18 video tokens in slices of 5 + 4, 2 heads), the
blocks of the transformer sharded over the 4 ranks (HSDP), FP8 K/V at every attention site (the
self-attention's scales reduced over the ranks, the cross-attention's on the replicated prompt)
and cache-dit's fixed skip schedule (the ranks keep the same rows). A text request with guidance
and an image request (its first frame at timestep 0: per-frame modulation whose frames the
ranks' slices cut) share each step.
"""
from __future__ import annotations

import torch

from tests.diffusion.conftest import WanCase, random_image, run_engine, video_of
from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.denoise import build_cache
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.process_group import DiffusionProcessGroup, ModelSpec, make_cache
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings

WAN = "vllm_omni.model_executor.models.wan2_2.model:WanModel"
CPU = torch.device("cpu")
TOLERANCE = 1e-4  # frames in [0, 1]
LAYOUT = DiffusionParallelConfig(ulysses_degree=2, ring_degree=2, ulysses_mode="advanced_uaa", use_hsdp=True)
FP8_KV = DenoiserAcceleration(attention=AttentionSettings(kv_cache_dtype="fp8"))
SKIPS = ("cache_dit", {"steps_computation_mask": [1, 1, 0, 1], "steps_computation_policy": "static"}, False)


def test_sequence_parallel_wan_gives_the_videos_of_one_process(wan_dir):
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    size = dict(height=64, width=96, num_frames=9, num_inference_steps=4)  # 3 x 2 x 3 = 18 tokens
    cases = [WanCase("text", "a red fox", "blurry", params=dict(size, seed=1, guidance_scale=4.0)),
             WanCase("image", "a boat", image=random_image(40, 56), params=dict(size, seed=2, guidance_scale=1.0))]
    reference = WanModel.load(wan_dir("ti2v"), device=CPU, dtype=torch.float32, acceleration=FP8_KV)
    single_cache = build_cache(SKIPS, "WanTransformer3DModel")
    one = run_engine(DiffusionEngine(reference, stage_id=0, max_batch_size=4, cache=single_cache), cases)

    spec = ModelSpec(WAN, str(wan_dir("ti2v")), "float32", acceleration=FP8_KV)
    group = DiffusionProcessGroup.start(spec, SKIPS, CPU, LAYOUT, init_timeout_s=120)
    try:
        model = spec.build(CPU, group.join())
        group.wait_loaded()
        cache = make_cache(model, SKIPS, group.groups)
        many = run_engine(DiffusionEngine(model, stage_id=0, max_batch_size=4, cache=cache, group=group), cases)
        weight = model.blocks[0][0].block.attn1.to_q.weight
        assert type(weight).__name__ == "DTensor" and weight.to_local().shape[0] == weight.shape[0] // 4
        assert model.c.text_encoder is not None  # rank 0 prepares the requests
        quantized = model.blocks[0][0].self_site.stats
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.processes)
    for case in cases:
        diff = (video_of(one[case.request_id]) - video_of(many[case.request_id])).abs().max().item()
        assert diff <= TOLERANCE, (case.request_id, diff)
    assert (cache.computed, cache.skipped) == (single_cache.computed, single_cache.skipped)
    assert cache.skipped > 0 and sum(quantized.values()) > 0
