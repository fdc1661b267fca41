"""Async scheduling on CUDA (runs only where CUDA is): the decode graphs read the tokens of the
step in flight on the device, the staging buffers alternate while a copy may still be queued, and
the host reads a step's tokens behind its own copy only. Every request's outputs equal the
synchronous engine's: a plain LLM (every sampling feature, preemption, streamed outputs) and
Qwen2.5-Omni's talker (its rows embedded on the device from the in-flight codes)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.core.test_async_scheduling import (  # noqa: E402
    assert_same, make_engine, probe_stops, prompts_for, request_mix, run)
from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.testing.talker_inputs import chat_prompt_ids, talker_prompt  # noqa: E402


@pytest.mark.parametrize("stream", [False, True])
def test_graph_steps_in_flight_give_the_synchronous_outputs(tiny_model, stream):
    model = tiny_model("qwen3")
    kw = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=14, max_num_seqs=5)
    sync_engine = make_engine(model, False, **kw)
    assert sync_engine.runner.graphs is not None
    prompts = prompts_for(7, sync_engine.vocab_size)
    params = request_mix(*probe_stops(model, prompts, **kw))
    sync, sync_streamed, _ = run(sync_engine, params, prompts, stream)
    fast, fast_streamed, seen = run(make_engine(model, True, **kw), params, prompts, stream)
    assert_same(sync, fast)
    assert seen["deferred"] > 0.5 * seen["steps"] and seen["preempted"] > 0
    if stream:
        assert fast_streamed == sync_streamed


def talker_codes(path, async_scheduling: bool, eager: bool) -> dict:
    eng = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="float32",
                                 enforce_eager=eager, enable_prefix_caching=False, max_num_seqs=8,
                                 async_scheduling=async_scheduling))
    assert eng._async == async_scheduling
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=40,
                             ignore_eos=True, detokenize=False)
    for i, (words, reply) in enumerate([(3, 4), (9, 12), (20, 30)]):  # three lengths in one batch
        prompt = talker_prompt(eng.model, "qwen2_5_omni", chat_prompt_ids(str(path), words), reply, seed=i)
        eng.add_request(str(i), prompt["prompt_token_ids"], sampled.clone(seed=i, max_tokens=30 + 5 * i),
                        model_inputs=prompt["additional_information"])
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o.new_token_ids) for o in eng.step() if o.finished)  # the one output: all
    return done


def test_qwen2_5_talker_in_flight_codes_are_the_synchronous_codes(tiny_model):
    path = tiny_model("qwen2_5_omni")
    want = talker_codes(path, async_scheduling=False, eager=True)
    assert [len(want[k]) for k in "012"] == [30, 35, 40]
    assert talker_codes(path, async_scheduling=True, eager=False) == want
    assert talker_codes(path, async_scheduling=True, eager=True) == want


@pytest.mark.parametrize("family,arch", [("qwen2_5_omni", "qwen2_5_omni"), ("qwen3_omni", "qwen3_omni_moe")])
def test_a_talker_decode_step_waits_only_for_the_step_before(tiny_model, family, arch):
    """In steady decode the host waits for nothing but the host copy of the tokens (and a Qwen3
    talker's frames) of the step launched before: no pageable copy, no .cpu() of this step's work."""
    from vllm_omni.model_executor.layers.moe import grouped_mm_available
    from vllm_omni.testing.cuda_syncs import format_syncs, trace_syncs

    if arch == "qwen3_omni_moe" and not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model(arch)
    eng = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="bfloat16",
                                 enable_prefix_caching=False, max_num_seqs=4, gpu_memory_utilization=0.1))
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, seed=1, max_tokens=40,
                            ignore_eos=True, detokenize=False)
    for i in range(3):
        prompt = talker_prompt(eng.model, family, chat_prompt_ids(str(path), 5 + i), 6, seed=i)
        eng.add_request(str(i), prompt["prompt_token_ids"], params, model_inputs=prompt["additional_information"],
                        stream=True)
    for _ in range(8):  # past the prefills
        eng.step()

    def steps():
        for _ in range(10):
            eng.step()

    syncs = [(n, stack) for n, stack in trace_syncs(steps) if "device_copy.py" not in stack.splitlines()[-1]]
    assert not syncs, "the host waited for the GPU:\n" + format_syncs(syncs)
    while eng.has_unfinished_requests():
        eng.step()
