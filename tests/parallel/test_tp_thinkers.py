"""The Qwen2.5-Omni and Qwen3-Omni thinkers at TP=2 against TP=1 (CPU, gloo, float32).

One batch of text, audio, image and audio+image requests (the towers run replicated on both
ranks; the decoder LM is sharded): greedy tokens identical, and the hidden states the talker
reads (input embeddings, the Qwen3 accept layer, the last layer) equal within float32 noise.
Also: a request whose media do not match its placeholders fails its step on both ranks, as at
TP=1, and the engine keeps serving (the ranks agree they are still in step).
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tests.models.test_qwen2_5_omni_thinker import make_prompt as qwen2_5_prompt
from tests.models.test_qwen3_omni_thinker import make_prompt as qwen3_prompt
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.model_executor.models.qwen3_omni import Qwen3OmniMoeThinkerForConditionalGeneration
from vllm_omni.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FAMILIES = {
    "qwen2_5_omni": (qwen2_5_prompt, ["text", "audio", "image", "image_audio"]),
    "qwen3_omni_moe": (qwen3_prompt, ["text", "audio", "image", "image_audio"]),
}


def thinker(path: str, tp: int) -> LLMEngine:
    layers = Qwen3OmniMoeThinkerForConditionalGeneration.exported_hidden_states(AutoConfig.from_pretrained(path))
    return LLMEngine(EngineConfig(model=path, model_stage="thinker", dtype="float32", hidden_state_layers=layers,
                                  tensor_parallel_size=tp))


def run_batch(engine: LLMEngine, requests: dict[str, tuple[list[int], dict]]) -> dict:
    for rid, (prompt, inputs) in requests.items():
        assert engine.add_request(rid, prompt, GREEDY, model_inputs=inputs or None,
                                  return_hidden_states=True) is None
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    assert all(out.error is None for out in done.values())
    return done


@pytest.fixture(scope="module")
def tp2_thinker(tiny_model):
    """family -> its thinker at TP=2, built once; rank processes stopped after the module."""
    engines: dict[str, LLMEngine] = {}

    def get(family: str) -> LLMEngine:
        if family not in engines:
            engines[family] = thinker(str(tiny_model(family)), 2)
        return engines[family]

    yield get
    for engine in engines.values():
        engine.runner.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_thinker_tp2_equals_tp1(family, tiny_model, tp2_thinker):
    make_prompt, kinds = FAMILIES[family]
    tp1 = thinker(str(tiny_model(family)), 1)
    requests = {kind: make_prompt(tp1.tokenizer, kind) for kind in kinds}
    expected = run_batch(tp1, requests)
    tp2 = tp2_thinker(family)
    assert tp2.model.model.layers[0].self_attn.num_heads == 2  # half of the 4 heads on rank 0
    got = run_batch(tp2, requests)
    for kind in kinds:
        ours, ref = got[kind], expected[kind]  # each request's one output: everything it made
        assert ours.new_token_ids == ref.new_token_ids, kind
        assert set(ours.multimodal_output) == set(ref.multimodal_output) >= {"0", "last"}
        for key, states in ref.multimodal_output.items():
            # Sharded sums round differently: float32 noise, relative to the states' scale (up to ~100).
            scale = float(states.abs().max())
            torch.testing.assert_close(ours.multimodal_output[key], states, atol=1e-5 * max(scale, 1.0), rtol=1e-5,
                                       msg=lambda m, kind=kind, key=key: f"{kind} {key}: {m}")


def test_failed_step_on_every_rank_fails_only_that_step(tp2_thinker):
    tp2 = tp2_thinker("qwen2_5_omni")
    prompt, inputs = qwen2_5_prompt(tp2.tokenizer, "image")
    image_token = tp2.tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    broken = prompt[:3] + [image_token] + prompt[3:]  # one placeholder more than the image has features
    tp2.add_request("broken", broken, GREEDY, model_inputs=inputs)
    # Raised by the model's hook on rank 0; rank 1 raised the same and stays in step: the request fails alone.
    (out,) = tp2.step()
    assert out.request_id == "broken" and "placeholder tokens" in out.error
    done = run_batch(tp2, {"after": qwen2_5_prompt(tp2.tokenizer, "image")})
    assert len(done["after"].new_token_ids) == GREEDY.max_tokens
