"""Per-request isolation inside one engine batch (real batching on a tiny model, in-process).

A request that makes the batched step raise fails alone; its batch mates produce exactly the
tokens they produce when run alone. An out-of-vocabulary prompt id is refused when added.
"""
from __future__ import annotations

import pytest
import torch

from vllm_omni import SamplingParams
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.stage_io import PROMPT_EMBEDS_KEY, StageRequest
from vllm_omni.worker.ar_stage_engine import ARStageEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model("qwen3")), max_num_seqs=8))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams, dict]]) -> dict[str, object]:
    finals = {}
    for rid, (ids, params, kw) in requests.items():
        early = engine.add_request(rid, ids, params, **kw)
        if early is not None:
            finals[rid] = early
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def solo(engine, ids, params):
    (out,) = run(engine, {"solo": (ids, params, {})}).values()
    return out.new_token_ids


def test_a_request_that_breaks_the_step_fails_alone(engine):
    hidden = engine.hf_config.hidden_size
    bad_embeds = torch.zeros(3, hidden + 1)  # one column too wide: fails inside the batched forward
    requests = {f"r{i}": (ids, SEEDED if i % 2 else GREEDY, {}) for i, ids in enumerate(PROMPTS)}
    requests["poison"] = ([20, 21, 22], GREEDY, {"prompt_embeds": bad_embeds})
    finals = run(engine, requests)
    assert finals["poison"].finish_reason == "error"
    assert "the engine step failed for this request" in finals["poison"].error
    for i, ids in enumerate(PROMPTS):
        out = finals[f"r{i}"]
        assert out.error is None and out.finish_reason == "length"
        assert out.new_token_ids == solo(engine, ids, SEEDED if i % 2 else GREEDY), f"r{i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def test_out_of_vocabulary_prompt_is_refused_when_added(engine):
    vocab = engine.vocab_size
    requests = {"ok": (PROMPTS[0], GREEDY, {}), "oov": ([1, 2, vocab], GREEDY, {}), "neg": ([-1], GREEDY, {})}
    finals = run(engine, requests)
    assert f"prompt token id {vocab} is not in the vocabulary" in finals["oov"].error
    assert "prompt token id -1" in finals["neg"].error
    assert finals["ok"].new_token_ids == solo(engine, PROMPTS[0], GREEDY)


def test_stage_engine_reports_the_culprit_and_keeps_the_batch(engine):
    stage = ARStageEngine(engine, stage_id=0, export_hidden_states=False)
    hidden = engine.hf_config.hidden_size
    reqs = [StageRequest(request_id=f"s{i}", prompt_token_ids=ids, sampling_params=GREEDY)
            for i, ids in enumerate(PROMPTS[:3])]
    reqs.insert(1, StageRequest(request_id="bad", prompt_token_ids=[3, 4], sampling_params=GREEDY,
                                additional_information={PROMPT_EMBEDS_KEY: torch.zeros(2, hidden + 3)}))
    for r in reqs:
        stage.add_request(r)
    finished = {}
    while stage.has_work():
        for out in stage.step():
            tokens = finished.setdefault(out.request_id, [])
            tokens.extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = (tokens, out.error)
    assert finished["bad"][1] is not None and "step failed" in finished["bad"][1]
    for i, ids in enumerate(PROMPTS[:3]):
        tokens, error = finished[f"s{i}"]
        assert error is None and tokens == solo(engine, ids, GREEDY)
