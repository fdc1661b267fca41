"""Two engines stepping at once in two threads of one process (two in-process stages,
`runtime.process: false`) must not see each other's per-step attention metadata."""
from __future__ import annotations

import threading

import pytest

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.sampling_params import SamplingParams
from tests.pipeline.conftest import random_prompts


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        assert engine.add_request(f"r{i}", ids, params) is None
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_two_engines_in_two_threads_equal_their_solo_runs(tiny_model, arch):
    # Different models and batch shapes: a step that read the other thread's metadata would
    # attend over the wrong blocks (or fail on a shape mismatch).
    configs = [EngineConfig(model=str(tiny_model(arch, seed=s)), device="cpu", max_num_seqs=n, seed=0)
               for s, n in ((0, 8), (1, 3))]
    prompts = [random_prompts(8, seed=11), random_prompts(5, seed=12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    solo = [_run(LLMEngine(c), p, params) for c, p in zip(configs, prompts)]

    engines = [LLMEngine(c) for c in configs]
    results: list[dict | BaseException] = [{}, {}]

    def work(i: int) -> None:
        try:
            results[i] = _run(engines[i], prompts[i], params)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "an engine thread hung"
    assert results == solo
