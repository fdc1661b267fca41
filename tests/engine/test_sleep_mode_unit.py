"""A stage engine in sleep mode (worker/sleep_mode.py) on the CPU: sleeping frees the engine (its
weights and KV tensors are collected), waking at level 1 writes the CPU copy into placeholder
weights, at level 2 reads the checkpoint again; the outputs after waking equal those before."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vllm_omni.config import load_pipeline_config
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import OutputKind, StageRequest
from vllm_omni.worker.gpu_ar_worker import GPUARWorker
from vllm_omni.worker.sleep_mode import SleepableEngine, SleepRefused, placeholder_weights


@pytest.fixture(scope="module")
def ar_stage(tiny_model):
    path = str(tiny_model("qwen3"))
    return path, load_pipeline_config(model=path, platform="cpu").stage(0)


def _sleepable(path, stage, built: list[bool]):
    def build(placeholder: bool):
        built.append(placeholder)
        return GPUARWorker(placeholder_weights(stage) if placeholder else stage, path, device="cpu").build_engine()

    return SleepableEngine(stage.stage_id, GPUARWorker(stage, path, device="cpu").build_engine(), build)


def _request(rid: str, max_tokens: int = 8) -> StageRequest:
    return StageRequest(request_id=rid, prompt_token_ids=[5, 17, 33, 2, 9, 41],
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        output_kind=OutputKind.FINAL_ONLY)


def _tokens(engine, rid: str) -> list[int]:
    engine.add_request(_request(rid))
    for _ in range(50):
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                return out.new_token_ids
    raise AssertionError("no output")


def test_sleep_frees_the_engine_and_both_levels_wake_to_the_same_outputs(ar_stage):
    path, stage = ar_stage
    built: list[bool] = []
    engine = _sleepable(path, stage, built)
    before = _tokens(engine, "a")
    inner = engine._engine.engine  # the LLMEngine: its model and KV tensors must go
    model, k_cache = weakref.ref(inner.model), weakref.ref(inner.runner.attention_layers[0].k_cache)
    del inner
    engine.sleep(1)
    gc.collect()
    assert engine.sleeping and model() is None and k_cache() is None
    engine.wake_up()
    assert not engine.sleeping and built == [True]  # placeholder weights, the snapshot written in
    assert _tokens(engine, "b") == before
    engine.sleep(2)
    engine.wake_up(["weights"])
    assert engine.sleeping  # the KV cache is not woken yet
    engine.wake_up(["kv_cache"])
    assert built == [True, False] and _tokens(engine, "c") == before  # read from the checkpoint again


def test_placeholder_weights_alone_would_answer_differently(ar_stage):
    """The level 1 check above is not vacuous: the placeholder (dummy) weights give other tokens."""
    path, stage = ar_stage
    real = GPUARWorker(stage, path, device="cpu").build_engine()
    dummy = GPUARWorker(placeholder_weights(stage), path, device="cpu").build_engine()
    assert _tokens(real, "r") != _tokens(dummy, "d")


def test_a_stage_with_requests_refuses_to_sleep_and_one_asleep_refuses_requests(ar_stage):
    path, stage = ar_stage
    engine = _sleepable(path, stage, [])
    engine.add_request(_request("busy", max_tokens=50))
    engine.step()
    with pytest.raises(SleepRefused, match="holds 1 request"):
        engine.sleep(1)
    engine.abort(["busy"])
    engine.sleep(2)
    engine.add_request(_request("late"))
    assert engine.has_work()
    (out,) = engine.step()
    assert out.request_id == "late" and "sleeping" in out.error


def test_an_aborted_last_request_leaves_no_work_behind(ar_stage):
    """Async scheduling keeps a step in flight; aborting the only request must not leave the engine
    reporting work it never does (the worker loop would spin)."""
    path, stage = ar_stage
    engine = GPUARWorker(stage, path, device="cpu").build_engine()
    engine.add_request(_request("x", max_tokens=50))
    engine.step()
    engine.step()
    engine.abort(["x"])
    engine.step()
    assert not engine.has_work()


def test_a_diffusion_stage_sleeps_and_wakes_to_the_same_image(tiny_model):
    from tests.diffusion.conftest import Case, image_of, run_engine
    from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

    path = str(tiny_model("qwen_image"))
    stage = load_pipeline_config(model=path, platform="cpu").stage(0)
    engine = SleepableEngine(0, GPUDiffusionWorker(stage, path, device="cpu").build_engine(), lambda placeholder:
                             GPUDiffusionWorker(placeholder_weights(stage) if placeholder else stage, path,
                                                device="cpu").build_engine())
    case = Case("i", "a red fox", params=dict(height=16, width=16, num_inference_steps=2, seed=1))
    before = image_of(run_engine(engine, [case])["i"])
    engine.sleep(1)
    engine.wake_up()
    assert torch.equal(image_of(run_engine(engine, [case])["i"]), before)
