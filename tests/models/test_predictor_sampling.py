"""The code predictors' in-graph sampling (`predictor_graphs.sample_codes`) draws from the same
distribution as our Sampler's top-k / top-p rule: empirical frequencies of many draws against
the probabilities the Sampler's own masking gives."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.model_executor.layers.sampler import apply_top_k_top_p
from vllm_omni.model_executor.models.predictor_graphs import sample_codes
from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling
from vllm_omni.sampling_params import SamplingParams

DRAWS = 40000


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 5, 1.0), (1.0, 5, 0.8), (0.7, 0, 0.9), (1.0, 0, 1.0)])
def test_draws_follow_the_sampler_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 2
    vocab = logits.shape[1]
    reference = apply_top_k_top_p(logits / temperature, torch.tensor([top_k if top_k > 0 else vocab]),
                                  torch.tensor([top_p])).softmax(dim=-1)[0]
    gumbel = -torch.empty(DRAWS, vocab).exponential_(generator=g).log()
    codes = sample_codes(logits.expand(DRAWS, -1), torch.zeros(DRAWS, dtype=torch.bool), gumbel, temperature,
                         top_k, top_p)
    frequencies = torch.bincount(codes, minlength=vocab).float() / DRAWS
    assert frequencies[reference == 0].sum() == 0  # nothing outside the top-k / nucleus
    assert (frequencies - reference).abs().max() < 0.01  # 4 standard deviations at most


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    gumbel = torch.full((3, 20), 100.0)
    gumbel[:, 0] = 1000.0  # noise that would pick code 0 for a sampled row
    codes = sample_codes(logits, torch.tensor([True, False, True]), gumbel, 1.0, 0, 1.0)
    assert codes.tolist() == [logits[0].argmax().item(), 0, logits[2].argmax().item()]


# --- the code predictor's settings: a stage's subtalker_sampling_params (predictor_sampling.py) -----

def _tts_codes(ckpt, settings: dict, params: dict) -> dict:
    from tests.models.test_qwen3_tts import case_prompt, run_talker
    from tests.reference.qwen_tts.cases import CASES
    from vllm_omni.core.engine_config import EngineConfig
    from vllm_omni.core.llm_engine import LLMEngine
    from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY
    from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor

    engine = LLMEngine(EngineConfig(model=str(ckpt), model_stage="talker", architecture="Qwen3TTSForConditionalGeneration",
                                    device="cpu", predictor_sampling=tuple(settings.items())))
    prompt = Qwen3TTSInputProcessor(ckpt, engine.tokenizer).process(case_prompt("CustomVoice",
                                                                                CASES["CustomVoice"][0]))
    out = run_talker(engine, {rid: prompt for rid in params}, params)
    return {rid: o.outputs[0].multimodal_output[CODES_KEY].tolist() for rid, o in out.items()}


@pytest.fixture(scope="module")
def tts_checkpoint(tiny_model):
    from tests.reference.qwen_tts.cases import SEED

    return tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")


def test_subtalker_greedy_is_qwen_tts_greedy(tts_checkpoint):
    """`do_sample: false` (qwen-tts' subtalker_dosample=False) with a greedy talker: the reference's codes."""
    from tests.models.test_qwen3_tts import fixture, greedy
    from tests.reference.qwen_tts.cases import CASES

    case = CASES["CustomVoice"][0]["name"]
    codes = _tts_codes(tts_checkpoint, {"do_sample": False, "temperature": 0.9}, {"g": greedy()})
    assert codes["g"] == fixture("CustomVoice")["cases"][case]["codes"]


def test_subtalker_sampling_applies_to_a_greedy_talker_and_is_seeded(tts_checkpoint):
    """`do_sample: true` samples groups 1..G-1 even for a greedy talker request (upstream's rule);
    the first frame's group 0 is still the talker's greedy code, the rest follow the seed."""
    from tests.models.test_qwen3_tts import fixture, greedy
    from tests.reference.qwen_tts.cases import CASES

    def seeded(seed: int) -> SamplingParams:
        return greedy().clone(seed=seed, max_tokens=6)

    codes = _tts_codes(tts_checkpoint, {"do_sample": True, "temperature": 1.0, "top_k": 0},
                       {"a": seeded(1), "b": seeded(1), "c": seeded(2)})
    reference = fixture("CustomVoice")["cases"][CASES["CustomVoice"][0]["name"]]["codes"]
    assert codes["a"] == codes["b"] != codes["c"]
    assert codes["a"][0][0] == reference[0][0] and codes["a"][0][1:] != reference[0][1:]


@pytest.mark.parametrize("values, match", [
    ({"do_samples": True}, r"unknown key\(s\) \['do_samples'\]"), ({"temperature": -1}, r"temperature=-1"),
    ({"top_p": 0}, r"top_p=0"), ({"do_sample": "yes"}, r"do_sample='yes'")])
def test_bad_settings_name_the_key(values, match):
    with pytest.raises(ValueError, match=match):
        PredictorSampling.parse(values)


def test_unset_do_sample_follows_the_talker():
    unset, on, off = PredictorSampling(), PredictorSampling(do_sample=True), PredictorSampling(do_sample=False)
    greedy_talker, sampled_talker = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9)
    assert [s.greedy_for(greedy_talker) for s in (unset, on, off)] == [True, False, True]
    assert [s.greedy_for(sampled_talker) for s in (unset, on, off)] == [False, False, True]
