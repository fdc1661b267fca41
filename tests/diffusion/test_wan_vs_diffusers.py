"""Wan2.2 on our diffusion engine against diffusers' own WanPipeline / WanImageToVideoPipeline.

The tiny checkpoints of the three released layouts (T2V-A14B, I2V-A14B, TI2V-5B), CPU,
float32, the same seed, size, frames and steps: each request's video equals diffusers' within
VIDEO_TOLERANCE, alone or batched with others (other prompts, seeds, step counts, an image or
none, one joining mid-way, so that one step runs rows on both experts).
"""
from __future__ import annotations

import pytest
import torch

from tests.diffusion.conftest import VIDEO_TOLERANCE, WAN_SIZES, WanCase, random_image, run_engine, video_of


def _engine(model, **kwargs):
    from vllm_omni.diffusion.engine import DiffusionEngine

    return DiffusionEngine(model, stage_id=0, max_batch_size=kwargs.pop("max_batch_size", 4), **kwargs)


def _params(layout: str, **kwargs) -> dict:
    return dict(WAN_SIZES[layout], num_frames=5, **kwargs)


def test_a14b_request_uses_both_experts_like_diffusers(wan_model, wan_pipes):
    """4 steps: timesteps 999, 900 on the high-noise expert (>= 875), 750, 500 on the low-noise one,
    each with its own guidance scale."""
    model = wan_model("a14b")
    case = WanCase("a", "a red fox running in the snow", negative="blurry",
                   params=_params("a14b", num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0, seed=5))
    prepared = model.prepare(case.request(), case.request().sampling_params)
    assert prepared.experts == (0, 0, 1, 1) and prepared.cfg_scales == (4.0, 4.0, 2.0, 2.0)
    video = video_of(run_engine(_engine(model), [case])["a"])
    reference = case.reference(wan_pipes("a14b"))
    assert video.shape == (1, 5, 3, 32, 48)
    assert (video - reference).abs().max() <= VIDEO_TOLERANCE
    same_scales = WanCase("b", case.prompt, case.negative, params={**case.params, "guidance_scale_2": 4.0})
    assert (same_scales.reference(wan_pipes("a14b")) - reference).abs().max() > 10 * VIDEO_TOLERANCE


def test_i2v_request_equals_diffusers(wan_model, wan_pipes):
    case = WanCase("i", "the cat turns its head", image=random_image(40, 56, seed=2),
                   params=_params("i2v", num_inference_steps=3, guidance_scale=3.0, seed=9))
    video = video_of(run_engine(_engine(wan_model("i2v")), [case])["i"])
    assert (video - case.reference(wan_pipes("i2v"))).abs().max() <= VIDEO_TOLERANCE


def test_ti2v_text_and_image_requests_batched_equal_diffusers(wan_model, wan_pipes):
    """TI2V-5B: one expert, a timestep per token; text to video and image to video share a step."""
    cases = [WanCase("t", "waves on a beach", params=_params("ti2v", num_inference_steps=3, seed=1)),
             WanCase("i", "a boat sails away", negative="fog", image=random_image(64, 80, seed=3),
                     params=_params("ti2v", num_inference_steps=2, guidance_scale=4.5, seed=2))]
    outputs = run_engine(_engine(wan_model("ti2v")), cases)
    for case in cases:
        video = video_of(outputs[case.request_id])
        assert video.shape == (1, 5, 3, 64, 64)
        assert (video - case.reference(wan_pipes("ti2v"))).abs().max() <= VIDEO_TOLERANCE, case.request_id


def test_batch_mates_do_not_change_a_request(wan_model, wan_pipes):
    """Different prompts, steps, seeds, videos per prompt and guidance, one request joining two
    steps late: at some steps the batch's rows run on different experts (one forward each)."""
    model = wan_model("a14b")
    cases = [WanCase("a", "a cat", params=_params("a14b", num_inference_steps=4, seed=1)),
             WanCase("b", "a small wooden boat on a calm lake", negative="people",
                     params=_params("a14b", num_inference_steps=3, guidance_scale=1.0, seed=2,
                                    num_outputs_per_prompt=2)),
             WanCase("c", "two apples", params=_params("a14b", num_inference_steps=4, seed=3))]  # joins later
    forwards: list[tuple[int, int]] = []
    original = model.make_batch

    def recording_make_batch(groups):
        forwards.append((groups[0].expert, sum(g.num_rows for g in groups)))
        return original(groups)

    model.make_batch = recording_make_batch
    try:
        outputs = run_engine(_engine(model), cases, join_after={"c": 2})
    finally:
        del model.make_batch
    # Step 3: a (guided: 2 rows) and b (unguided: 2 videos) on the low-noise expert, c (2 rows) on the high one.
    assert (1, 4) in forwards and (0, 2) in forwards
    for case in cases:
        video, reference = video_of(outputs[case.request_id]), case.reference(wan_pipes("a14b"))
        assert video.shape == reference.shape
        assert (video - reference).abs().max() <= VIDEO_TOLERANCE, case.request_id


@pytest.mark.parametrize("layout,params,image,error", [
    ("a14b", {}, True, "takes no input image"),
    ("i2v", {}, False, "needs an input image"),
    ("a14b", {"num_frames": 6}, False, "num_frames=6 is invalid"),
    ("ti2v", {"height": 48}, False, "height=48 is invalid for this model: must be a multiple of 32"),
    ("ti2v", {"guidance_scale_2": 2.0}, False, "guidance_scale_2 applies to two-expert models"),
])
def test_requests_that_cannot_run_fail_alone(wan_model, layout, params, image, error):
    case = WanCase("bad", "x", image=random_image(32, 48) if image else None,
                   params={**_params(layout, num_inference_steps=2, seed=0), **params})
    out = run_engine(_engine(wan_model(layout)), [case])["bad"]
    assert out.error is not None and error in out.error


def test_prompt_cleaning_and_padding_match_diffusers(wan_model, wan_pipes):
    """Prompts are cleaned (HTML entities, whitespace) and padded to 512 tokens as the pipeline does."""
    model, pipe = wan_model("a14b"), wan_pipes("a14b")["t2v"]
    text = "  a &amp; b\n\n  c  "
    ours = model.encoder.encode(text, torch.device("cpu"))
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=512)
    assert ours.shape == theirs.shape == (1, 512, 16)
    assert torch.equal(ours, theirs)


def test_the_diffusers_adapter_gets_the_frames_and_both_guidance_scales(wan_pipes):
    """--diffusion-load-format diffusers: a request's num_frames and guidance_scale_2 reach the pipeline call."""
    from vllm_omni.diffusion.diffusers_engine import DiffusersPipelineEngine

    case = WanCase("d", "a cat", params=_params("a14b", num_inference_steps=2, guidance_scale=3.0,
                                                 guidance_scale_2=1.5, seed=7))
    video = video_of(run_engine(DiffusersPipelineEngine(wan_pipes("a14b")["t2v"], stage_id=0, device="cpu"),
                                [case])["d"])
    assert torch.equal(video, case.reference(wan_pipes("a14b")))
