"""TeaCache on the tiny Qwen-Image: its quality cost (PSNR against no cache) and its per-row state."""
from __future__ import annotations

import math

import torch

from tests.diffusion.conftest import Case, image_of, run_engine
from vllm_omni.diffusion.tea_cache import MODEL_COEFFICIENTS, TeaCache, TeaCacheConfig

STEPS = 20


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)  # images in [0, 1]


def _cases() -> list[Case]:
    return [Case("cfg", "a red fox in the snow", negative="blurry",
                 params=dict(height=64, width=64, num_inference_steps=STEPS, seed=1)),
            Case("plain", "a green field", params=dict(height=64, width=64, num_inference_steps=STEPS, seed=2))]


def test_tea_cache_psnr_against_no_cache(make_engine, record_property):
    cases = _cases()
    exact = {k: image_of(o) for k, o in run_engine(make_engine(), cases).items()}
    cache = TeaCache(TeaCacheConfig(rel_l1_thresh=0.2))  # the documented default, Qwen-Image coefficients
    cached = {k: image_of(o) for k, o in run_engine(make_engine(cache=cache), cases).items()}
    other_seed = image_of(run_engine(make_engine(), [Case("s", cases[0].prompt, cases[0].negative,
                                                          params={**cases[0].params, "seed": 9})])["s"])
    rows = 3 * STEPS  # cfg: 2 rows per step, plain: 1
    skipped = cache.skipped / rows
    quality = {k: psnr(cached[k], exact[k]) for k in exact}
    scale = psnr(other_seed, exact["cfg"])  # what "a different image" scores, for scale
    print(f"\nTeaCache rel_l1_thresh=0.2 over {STEPS} steps: {cache.skipped}/{rows} row-steps skipped; "
          f"PSNR vs no cache: {quality}; a different seed scores {scale:.1f} dB")
    record_property("tea_cache_psnr_db", quality)
    record_property("tea_cache_skipped_fraction", skipped)
    assert cache.computed + cache.skipped == rows
    assert skipped >= 0.5  # it does skip: otherwise the PSNR below would prove nothing
    assert all(q >= 35.0 for q in quality.values())  # close to the uncached image ...
    assert all(q >= scale + 15.0 for q in quality.values())  # ... and far closer than another image


def test_a_threshold_that_never_triggers_changes_nothing(make_engine):
    cases = _cases()[:1]
    exact = image_of(run_engine(make_engine(), cases)["cfg"])
    cache = TeaCache(TeaCacheConfig(rel_l1_thresh=1e-12))
    assert torch.equal(image_of(run_engine(make_engine(cache=cache), cases)["cfg"]), exact)
    assert cache.skipped == 0


def test_rows_keep_their_own_state_and_finished_rows_are_forgotten():
    cache = TeaCache(TeaCacheConfig(rel_l1_thresh=0.5, coefficients=(0.0, 0.0, 0.0, 1.0, 0.0)))  # distance as is
    block_input = torch.zeros(2, 3, 4)
    runs: list[list[int] | None] = []

    def run_blocks(rows):
        runs.append(None if rows is None else rows.tolist())
        n = 2 if rows is None else len(rows)
        return torch.ones(n, 3, 4)

    same = torch.ones(2, 3, 4)
    cache.run(["a", "b"], same, block_input, run_blocks)  # first step: both compute
    moved = same.clone()
    moved[1] *= 3  # row b's input moves a lot, row a's not at all
    out = cache.run(["a", "b"], moved, block_input, run_blocks)
    assert runs == [None, [1]]  # only b ran its blocks
    assert torch.equal(out, torch.ones(2, 3, 4))  # a reused its residual (1), b computed 1
    cache.retain(["b"])
    cache.run(["a", "b"], moved, block_input, run_blocks)
    assert runs[-1] == [0]  # a is new again (must compute); b is unchanged and skips


def test_the_documented_qwen_image_coefficients():
    assert MODEL_COEFFICIENTS["QwenImageTransformer2DModel"] == (-450.0, 280.0, -45.0, 3.2, -0.02)
    config = TeaCacheConfig.for_model("QwenImageTransformer2DModel", {"rel_l1_thresh": 0.3})
    assert config.rel_l1_thresh == 0.3 and config.rescale(0.1) == -450e-4 + 280e-3 - 45e-2 + 3.2e-1 - 0.02
