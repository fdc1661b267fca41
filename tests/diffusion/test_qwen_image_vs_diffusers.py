"""Qwen-Image text to image on our diffusion engine against diffusers' own QwenImagePipeline.

Same tiny checkpoint, seed, size and steps, CPU float32, no cache: a request alone gives
diffusers' image to the bit; requests batched together (different prompts, prompt lengths,
guidance, step counts, seeds, images per prompt, and one joining mid-way) each give their solo
image up to float32 rounding of the batched matmuls.
"""
from __future__ import annotations

import torch

from tests.diffusion.conftest import BATCH_TOLERANCE, Case, image_of, run_engine

SIZE = dict(height=64, width=64)


def test_one_request_equals_diffusers_exactly(make_engine, t2i_pipe):
    case = Case("solo", "a red fox in the snow", params=dict(SIZE, num_inference_steps=3, seed=11))
    out = run_engine(make_engine(max_batch_size=1), [case])
    image = image_of(out["solo"])
    reference = case.reference(t2i_pipe)
    assert image.shape == (1, 3, 64, 64)
    assert torch.equal(image, reference)
    # Not a constant image: a different seed gives a different one.
    other = Case("other", case.prompt, params=dict(SIZE, num_inference_steps=3, seed=12)).reference(t2i_pipe)
    assert (other - reference).abs().max() > 0.01


def test_guided_request_equals_diffusers(make_engine, t2i_pipe):
    """true CFG: the conditional and unconditional rows share one forward (diffusers runs two)."""
    case = Case("cfg", "a lighthouse at night, oil painting", negative="blurry, low quality",
                params=dict(SIZE, num_inference_steps=3, true_cfg_scale=4.0, seed=3))
    image = image_of(run_engine(make_engine(), [case])["cfg"])
    reference = case.reference(t2i_pipe)
    unguided = Case("u", case.prompt, params=dict(SIZE, num_inference_steps=3, seed=3)).reference(t2i_pipe)
    assert (image - reference).abs().max() <= BATCH_TOLERANCE
    assert (unguided - reference).abs().max() > 100 * BATCH_TOLERANCE  # guidance changed the image


def test_batch_of_different_requests_each_equals_its_solo_run(make_engine, t2i_model, t2i_pipe):
    cases = [
        Case("a", "a cat", params=dict(SIZE, num_inference_steps=4, seed=1)),
        Case("b", "a small wooden boat on a calm lake at sunrise", negative="people",
             params=dict(SIZE, num_inference_steps=3, true_cfg_scale=3.0, seed=2)),
        Case("c", "two apples", params=dict(SIZE, num_inference_steps=5, seed=3, num_outputs_per_prompt=2)),
        Case("d", "a castle", negative="fog", params=dict(SIZE, num_inference_steps=2, seed=4)),  # joins later
    ]
    forwards: list[int] = []
    original = t2i_model.make_batch

    def counting_make_batch(groups):
        forwards.append(sum(g.num_rows for g in groups))
        return original(groups)

    t2i_model.make_batch = counting_make_batch
    try:
        outputs = run_engine(make_engine(max_batch_size=4), cases, join_after={"d": 2})
    finally:
        del t2i_model.make_batch
    # One forward per step for the whole batch: a+b(2 rows)+c(2) = 5 rows, then d's 2 rows join.
    assert max(forwards) == 7 and len(forwards) == 5
    for case in cases:
        image, reference = image_of(outputs[case.request_id]), case.reference(t2i_pipe)
        assert image.shape == reference.shape
        assert (image - reference).abs().max() <= BATCH_TOLERANCE, case.request_id
