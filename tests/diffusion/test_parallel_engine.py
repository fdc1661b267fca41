"""Tiny Qwen-Image generations over several CPU ranks (gloo) against the one-process images.

One run per layout that matters, each a real world of spawned ranks that load the model:
Ulysses 2 (uneven tokens and heads, with HSDP over both ranks, TeaCache and a patch-parallel VAE
decode, built from a stage config by the worker), ring 2 (with layerwise offload on every rank),
Ulysses 2 x ring 2 with FP8 K/V (standalone HSDP is checked on its own in test_sequence_parallel.py).
Images agree within float32 rounding: sequence parallelism runs the CompilableBlock form of the
blocks and attention over split key blocks.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.diffusion.conftest import Case, image_of, run_engine
from vllm_omni.config import load_pipeline_config
from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.process_group import DiffusionProcessGroup, ModelSpec
from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig
from vllm_omni.model_executor.layers.diffusion_parallel import DiffusionParallelism
from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelGroup
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings
from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

QWEN_IMAGE = "vllm_omni.model_executor.models.qwen_image.model:QwenImageModel"
CPU = torch.device("cpu")
TOLERANCE = 1e-4  # pixels in [0, 1]; measured differences are ~1e-5
FP8_KV = DenoiserAcceleration(attention=AttentionSettings(kv_cache_dtype="fp8"))


def _case(rid: str, size: tuple[int, int], steps: int = 3, guided: bool = True, seed: int = 1) -> Case:
    height, width = size
    return Case(rid, "a red fox in the snow", negative="blurry" if guided else None,
                params=dict(height=height, width=width, num_inference_steps=steps, seed=seed))


@contextlib.contextmanager
def _parallel_engine(model_dir: Any, layout: DiffusionParallelConfig,
                     acceleration: DenoiserAcceleration = DenoiserAcceleration(),
                     layerwise_offload: bool = False) -> Iterator[DiffusionEngine]:
    spec = ModelSpec(QWEN_IMAGE, str(model_dir), "float32", acceleration=acceleration,
                     layerwise_offload=layerwise_offload)
    group = DiffusionProcessGroup.start(spec, None, CPU, layout, init_timeout_s=120)
    try:
        model = spec.build(CPU, group.join())
        group.wait_loaded()
        yield DiffusionEngine(model, stage_id=0, max_batch_size=4, group=group)
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.processes)


def _assert_same_images(one: dict, many: dict, cases: list[Case], tolerance: float = TOLERANCE) -> None:
    for case in cases:
        diff = (image_of(one[case.request_id]) - image_of(many[case.request_id])).abs().max().item()
        assert diff <= tolerance, (case.request_id, diff)


def test_ulysses_with_hsdp_tea_cache_and_vae_patches_from_a_stage_config(qwen_image_dir, make_engine):
    """9 image tokens and 3 heads over 2 Ulysses ranks (advanced_uaa: 5 + 4 tokens, heads padded to
    4), prompts of different lengths in one forward (CFG), TeaCache skipping rows on both ranks
    alike, the transformer blocks sharded over both ranks, a 24-row latent decoded in two bands."""
    cli = dict(ulysses_degree=2, ulysses_mode="advanced_uaa", use_hsdp=True, vae_patch_parallel_size=2,
               num_gpus=2, cache_backend="tea_cache", cache_config={"rel_l1_thresh": 0.2})
    stage = load_pipeline_config(model=qwen_image_dir, cli_args=cli, stage_overrides={"0": {"devices": "0,1"}},
                                 platform="cpu").stage(0)
    cases = [_case("uneven", (48, 48), steps=12), _case("bands", (192, 64), steps=2, guided=False, seed=2)]
    single_cache = TeaCache(TeaCacheConfig(rel_l1_thresh=0.2))
    one = run_engine(make_engine(cache=single_cache), cases)
    engine = GPUDiffusionWorker(stage, str(qwen_image_dir), device="cpu").build_engine()
    try:
        assert engine.describe().details["parallel"]["world_size"] == 2
        block = engine.model.blocks[0].block.attn.to_q.weight
        assert type(block).__name__ == "DTensor" and block.to_local().shape[0] == block.shape[0] // 2
        many = run_engine(engine, cases)
        _assert_same_images(one, many, cases)
        assert (engine.cache.computed, engine.cache.skipped) == (single_cache.computed, single_cache.skipped)
        assert engine.cache.skipped > 0
    finally:
        engine.group.close()


@pytest.mark.parametrize("layout, cases, fp8_kv", [
    # Ring only: uneven blocks (5 + 4 tokens), every key block seen once around the ring; every rank
    # offloads its blocks layerwise (enable_layerwise_offload: each rank its own ring of buffers).
    (DiffusionParallelConfig(ring_degree=2, ulysses_mode="advanced_uaa"), [_case("ring", (48, 48))], False),
    # Ulysses inside, ring across: 8 tokens (2 per rank) and 9 (ring chunks 5 + 4, then 3 + 2, 2 + 2), with
    # FP8 K/V at every joint attention (the scales' absmax reduced over the ranks, padded prompt tokens too).
    (DiffusionParallelConfig(ulysses_degree=2, ring_degree=2, ulysses_mode="advanced_uaa"),
     [_case("usp8", (32, 64)), _case("usp9", (48, 48), guided=False, seed=3)], True),
], ids=["ring2", "ulysses2xring2_fp8kv"])
def test_sequence_parallel_layouts_give_the_images_of_one_process(qwen_image_dir, make_engine, layout, cases, fp8_kv):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    acceleration = FP8_KV if fp8_kv else DenoiserAcceleration()
    reference = QwenImageModel.load(qwen_image_dir, device=CPU, dtype=torch.float32, acceleration=acceleration) \
        if fp8_kv else None
    one = run_engine(make_engine(model=reference), cases)
    offload = layout.ulysses_degree == 1
    with _parallel_engine(qwen_image_dir, layout, acceleration, layerwise_offload=offload) as engine:
        assert bool(engine.model.blocks[1]._forward_hooks) == offload  # the offload's hook on an offloaded block
        many = run_engine(engine, cases)
        quantized = engine.model.blocks[0].site.stats if fp8_kv else None
    _assert_same_images(one, many, cases)
    assert not fp8_kv or sum(quantized.values()) > 0


def test_strict_mode_refuses_at_startup_and_per_request(t2i_model, make_engine):
    """Strict mode: 3 heads cannot be split over 2 Ulysses ranks (the model refuses to start), and a
    request of 9 image tokens cannot be split over 2 ring ranks (that request fails, with the reason)."""
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    ulysses = SequenceParallelGroup(2, 0, None, 1, 0, None, (0,), None, "strict")
    with pytest.raises(ValueError, match=r"head count \(3\) divisible by ulysses_degree=2"):
        QwenImageModel(t2i_model.c, device=CPU, parallel=DiffusionParallelism(sequence=ulysses))
    ring = SequenceParallelGroup(1, 0, None, 2, 0, None, (0, 1), None, "strict")
    model = QwenImageModel(t2i_model.c, device=CPU, parallel=DiffusionParallelism(sequence=ring))
    out = run_engine(make_engine(model=model), [_case("odd", (48, 48))])["odd"]
    assert "sequence length (9 tokens) divisible by ulysses_degree x ring_degree = 2" in out.error


def test_only_rank_zero_loads_the_text_encoder(qwen_image_dir):
    """Rank 0 prepares every request; the other ranks leave out the (7B, in Qwen-Image) text encoder."""
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    other = QwenImageModel.load(qwen_image_dir, device=CPU, dtype=torch.float32, parallel=DiffusionParallelism(rank=1))
    assert other.c.text_encoder is None and other.c.transformer is not None
