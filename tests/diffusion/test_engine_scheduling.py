"""The diffusion engine's scheduling: step boundaries, aborts, sizes, failures, limits."""
from __future__ import annotations

import torch

from tests.diffusion.conftest import BATCH_TOLERANCE, Case, image_of, random_image, run_engine
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest


def _case(rid: str, steps: int = 3, size: int = 32, seed: int = 0, **extra) -> Case:
    return Case(rid, f"prompt {rid}", params=dict(height=size, width=size, num_inference_steps=steps, seed=seed,
                                                  **extra))


def test_abort_between_steps_frees_the_batch_slot(make_engine, t2i_pipe):
    engine = make_engine(max_batch_size=1)
    long, short = _case("long", steps=50), _case("short", steps=2, seed=5)
    engine.add_request(long.request())
    engine.add_request(short.request())
    engine.step()
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["long"]
    assert engine.stats()["num_waiting"] == 1
    engine.abort(["long"])  # between two steps
    assert engine.stats() == {"num_unfinished": 1, "num_waiting": 1, "num_running": 0, "diffusion_steps": 2}
    outputs = {}
    for _ in range(3):  # the waiting request takes the slot at the next step and finishes in its 2 steps
        outputs.update({o.request_id: o for o in engine.step()})
    assert set(outputs) == {"short"} and not engine.has_work()
    assert engine.stats()["diffusion_steps"] == 4
    assert (image_of(outputs["short"]) - short.reference(t2i_pipe)).abs().max() <= BATCH_TOLERANCE


def test_other_sizes_wait_in_turn_and_later_same_size_requests_do_not_overtake(make_engine, t2i_model, t2i_pipe):
    keys: list[set] = []
    original = t2i_model.make_batch

    def recording_make_batch(groups):
        keys.append({g.prepared.batch_key for g in groups})
        return original(groups)

    engine = make_engine(max_batch_size=4)
    cases = [_case("a32", size=32), _case("b48", size=48, seed=1), _case("c32", size=32, seed=2)]
    t2i_model.make_batch = recording_make_batch
    try:
        outputs = run_engine(engine, cases)
    finally:
        del t2i_model.make_batch
    assert all(len(k) == 1 for k in keys)  # never two sizes in one forward
    # a32 runs alone (b48 does not fit, and c32 may not overtake b48), then b48, then c32.
    assert [next(iter(k))[0] for k in keys] == [32] * 3 + [48] * 3 + [32] * 3
    for case in cases:
        assert (image_of(outputs[case.request_id]) - case.reference(t2i_pipe)).abs().max() <= BATCH_TOLERANCE


def test_a_request_that_cannot_start_fails_alone(make_engine):
    engine = make_engine(max_batch_size=4, max_image_pixels=48 * 48)
    good = _case("good", steps=2)
    with_image = Case("image", "edit this", image=random_image(16, 16), params=good.params)  # t2i takes no image
    too_large = _case("large", size=64)
    text_params = StageRequest(request_id="text", prompt_token_ids=[], prompt="x", sampling_params=SamplingParams())
    engine.add_request(text_params)
    for case in (with_image, good, too_large):
        engine.add_request(case.request())
    outputs = {}
    while engine.has_work():
        outputs.update({o.request_id: o for o in engine.step()})
    assert "DiffusionSamplingParams" in outputs["text"].error
    assert "takes no input image" in outputs["image"].error
    assert "64x64 (4096 pixels) is over max_generated_image_size=2304" in outputs["large"].error
    assert all(outputs[r].finish_reason == "error" for r in ("text", "image", "large"))
    assert image_of(outputs["good"]).shape == (1, 3, 32, 32)


def test_a_failed_step_fails_its_batch_and_the_engine_goes_on(make_engine, t2i_model):
    engine = make_engine(max_batch_size=2)
    original = t2i_model.embed

    def broken_embed(batch):
        raise RuntimeError("out of memory (simulated)")

    engine.add_request(_case("x").request())
    t2i_model.embed = broken_embed
    try:
        failed = engine.step()
    finally:
        del t2i_model.embed
    assert [o.request_id for o in failed] == ["x"] and "out of memory (simulated)" in failed[0].error
    assert not engine.has_work()
    assert t2i_model.embed == original
    out = run_engine(engine, [_case("y", steps=2)])
    assert image_of(out["y"]).shape == (1, 3, 32, 32)
    assert torch.isfinite(out["y"].multimodal_output["image"]).all()


def test_one_step_with_shift_terminal_is_refused(make_engine):
    out = run_engine(make_engine(), [_case("one", steps=1)])
    assert "num_inference_steps=1 gives an undefined schedule" in out["one"].error
