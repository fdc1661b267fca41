"""`--cache-backend cache_dit` (DBCache per row, diffusion/db_cache.py): cache-dit's decision rules,
a fixed skip schedule that skips exactly its steps' middle blocks, and the quality cost."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.diffusion.conftest import Case, image_of, run_engine
from tests.diffusion.test_tea_cache import psnr
from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.diffusion.db_cache import DBCache, DBCacheConfig

QWEN_IMAGE = {"architectures": ["QwenImagePipeline"]}


def _toy_blocks(calls: list[tuple[int, int, int]]):
    """Three blocks that each add 1: the Fn residual never changes (diff 0: cacheable when allowed)."""
    def run_range(rows, state, start, end):
        calls.append((start, end, state[0].shape[0]))
        return state[0] + (end - start), None
    return run_range


def test_cache_dit_continuous_cached_steps_rule():
    """cache-dit's counting (CachedContext.add_cached_step / can_cache): a run of cached steps
    reaching max_continuous_cached_steps resets the count and computes; a cached step after a
    gap does not restart the count, the next adjacent one adds 2."""
    cache = DBCache(DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2,
                                  max_continuous_cached_steps=2, residual_diff_threshold=0.1))
    calls: list[tuple[int, int, int]] = []
    computed = []
    for step in range(8):
        calls.clear()
        out = cache.run([("r", False, 0, 0)], 3, (torch.zeros(1, 2, 4), None), _toy_blocks(calls))
        assert torch.equal(out, torch.full((1, 2, 4), 3.0))  # the cached middle residual is the computed one
        computed.append(any(c[:2] == (1, 2) for c in calls))
        assert calls[0][:2] == (0, 1) and calls[-1][:2] == (2, 3)  # Fn and Bn blocks always run
    assert [s for s, c in enumerate(computed) if c] == [0, 1, 4, 7]


def test_max_cached_steps_caps_reuse_and_a_moving_residual_is_not_reused():
    calls: list[tuple[int, int, int]] = []
    capped = DBCache(DBCacheConfig(max_warmup_steps=1, max_cached_steps=2, max_continuous_cached_steps=-1))
    for _ in range(6):
        capped.run([("r", False, 0, 0)], 3, (torch.zeros(1, 2, 4), None), _toy_blocks(calls))
    assert (capped.skipped, capped.computed) == (2, 4)
    moving = DBCache(DBCacheConfig(max_warmup_steps=1, max_continuous_cached_steps=-1))
    for step in range(6):  # the first block's residual doubles every step: diff 1 >= 0.24
        def run_range(rows, state, start, end, growth=2.0 ** step):
            return state[0] + (growth if start == 0 else 1.0) * (end - start), None
        moving.run([("r", False, 0, 0)], 3, (torch.zeros(1, 2, 4), None), run_range)
    assert (moving.skipped, moving.computed) == (0, 6)
    assert list(moving._rows.values())[0].diffs == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}


STEPS = 8
CASE = Case("c", "a red fox in the snow", negative="blurry", params=dict(height=64, width=64,
                                                                        num_inference_steps=STEPS, seed=1))


@pytest.fixture(scope="module")
def exact(t2i_model):
    from vllm_omni.diffusion.engine import DiffusionEngine

    return image_of(run_engine(DiffusionEngine(t2i_model, stage_id=0, max_batch_size=2), [CASE])["c"])


def test_a_fixed_schedule_skips_exactly_its_steps_middle_blocks(make_engine, t2i_model, exact):
    """steps_computation_mask with the static policy: the steps marked 0 run the first block (Fn)
    only, for both CFG rows; hooks count the rows each block ran."""
    mask = [1, 1, 1, 0, 1, 0, 0, 1]
    cache = DBCache(DBCacheConfig.from_settings({"steps_computation_mask": mask, "scm_steps_policy": "static",
                                                 "max_warmup_steps": 2}))
    blocks = t2i_model.c.transformer.transformer_blocks
    rows_seen = [0] * len(blocks)
    hooks = [b.register_forward_hook(lambda m, a, kw, out, i=i: rows_seen.__setitem__(i, rows_seen[i] + out[1].shape[0]),
                                     with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        cached = image_of(run_engine(make_engine(cache=cache), [CASE])["c"])
    finally:
        for h in hooks:
            h.remove()
    assert rows_seen[0] == 2 * STEPS  # Fn_compute_blocks 1: always, both branches
    assert all(n == 2 * sum(mask) for n in rows_seen[1:])  # the middle blocks: the mask's 1s only
    assert (cache.skipped, cache.computed) == (2 * mask.count(0), 2 * sum(mask))
    assert 20.0 < psnr(cached, exact) < float("inf")


def test_dbcache_quality_against_no_cache_and_its_summary(make_engine, exact, caplog):
    # The tiny random model's residual diffs are 0.25-0.41 a step: a threshold of 0.5 reuses some.
    cache = DBCache(DBCacheConfig(residual_diff_threshold=0.5, max_warmup_steps=2), summary=True)
    with caplog.at_level(logging.INFO, logger="vllm_omni.diffusion.db_cache"):
        cached = image_of(run_engine(make_engine(cache=cache), [CASE])["c"])
    quality = psnr(cached, exact)
    print(f"\nDBCache (F1B0 W2 R0.5 MC3) over {STEPS} steps: {cache.skipped}/{cache.skipped + cache.computed} "
          f"row-steps reused; PSNR vs no cache {quality:.1f} dB")
    assert cache.skipped >= 4 and cache.computed + cache.skipped == 2 * STEPS
    assert quality >= 25.0
    summary = [r.message for r in caplog.records if "cache-dit summary, request c" in r.message]
    assert len(summary) == 1 and "| cond | 1 |" in summary[0] and "| CFG | 1 |" in summary[0]
    assert not cache._rows  # the finished request's rows are gone


@pytest.mark.parametrize("settings, match", [
    ({"enable_taylorseer": True}, "TaylorSeer calibration is not implemented"),
    ({"scm_steps_mask_policy": "fast"}, "predefined step masks"),
    ({"Fn_compute_blocks": 0}, "Fn_compute_blocks=0: expected an integer >= 1"),
    ({"steps_computation_mask": [1, 2]}, "one per step"),
    ({"rel_l1_thresh": 0.2, "Fn_compute_blocks": 1}, "not both")])
def test_bad_cache_dit_settings_are_refused_with_the_reason(settings, match):
    with pytest.raises(ConfigError, match=match):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu",
                             cli_args={"cache_backend": "cache_dit", "cache_config": settings})


def test_cache_dit_settings_reach_the_stage_and_the_summary_needs_cache_dit():
    stage = load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
        "cache_backend": "cache_dit", "enable_cache_dit_summary": True,
        "cache_config": {"Fn_compute_blocks": 2, "max_warmup_steps": 3}}).stage(0)
    config = DBCacheConfig.from_settings(dict(stage.engine_args.cache_config))
    assert (config.Fn_compute_blocks, config.max_warmup_steps, config.Bn_compute_blocks) == (2, 3, 0)
    with pytest.raises(ConfigError, match="enable_cache_dit_summary.*cache_backend is tea_cache"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu",
                             cli_args={"cache_backend": "tea_cache", "enable_cache_dit_summary": True})


def test_the_worker_builds_a_stage_with_every_acceleration_setting(qwen_image_dir):
    """From the stage config to the engine: DBCache with its summary, FP8 weights, FP8 K/V, roles."""
    from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

    stage = load_pipeline_config(model=qwen_image_dir, platform="cpu", cli_args={
        "cache_backend": "cache_dit", "cache_config": {"Fn_compute_blocks": 1}, "enable_cache_dit_summary": True,
        "diffusion_quantization_config": {"method": "fp8"}, "diffusion_kv_cache_dtype": "fp8",
        "diffusion_kv_cache_skip_layers": "0", "diffusion_attention_config": {"per_role": {"joint": {
            "backend": "TORCH_SDPA"}}}}).stage(0)
    engine = GPUDiffusionWorker(stage, str(qwen_image_dir), device="cpu").build_engine()
    info = engine.describe()
    assert (info["cache_backend"], info["quantization"], info["kv_cache_dtype"]) == ("cache_dit", "fp8", "fp8")
    assert isinstance(engine.cache, DBCache) and engine.cache.summary
    sites = [b.site for b in engine.model.blocks]
    assert [s.quantize for s in sites] == [False, True] and {s.backend for s in sites} == {"TORCH_SDPA"}
