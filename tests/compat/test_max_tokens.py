"""max_tokens as vLLM bounds it (docs/compatibility.md, "max_tokens"): a stage's default is a
default, not a cap; the context (max_model_len after the prompt) bounds every request, and a
request's own standard max_tokens that cannot fit is vLLM's 400; an explicit cap
(`max_tokens_limit`, --max-tokens-limit) guards a stage and is off unless configured."""
from __future__ import annotations

import pytest

from tests.compat.test_upstream_files import UPSTREAM
from vllm_omni.config import load_pipeline_config
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.entrypoints.openai.errors import APIError, from_request_failure
from vllm_omni.entrypoints.openai.protocol import SamplingFields
from vllm_omni.entrypoints.openai.request_params import resolve_sampling_params
from vllm_omni.sampling_params import SamplingParams

QWEN3_OMNI = UPSTREAM / "vllm_omni/model_executor/stage_configs/qwen3_omni_moe.yaml"
# upstream's examples/online_serving/qwen3_omni client (run_curl_multimodal_generation.sh sends the same)
UPSTREAM_LIST = [
    {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 16384, "repetition_penalty": 1.05,
     "stop_token_ids": [151645], "seed": 42},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
     "repetition_penalty": 1.05, "stop_token_ids": [2150]},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096 * 16, "seed": 42, "detokenize": True,
     "repetition_penalty": 1.1},
]


def resolve(body: dict, **config) -> list[SamplingParams]:
    pipeline = load_pipeline_config(QWEN3_OMNI, **config)
    return resolve_sampling_params(pipeline, SamplingFields(**body), stage_config_wins=True)


def test_upstreams_sampling_params_list_is_taken_as_sent():
    params = resolve({"sampling_params_list": UPSTREAM_LIST})
    assert [p.max_tokens for p in params] == [16384, 4096, 65536]
    assert not any(p._max_tokens_must_fit for p in params)  # the context bounds them: the stage stops there


@pytest.mark.parametrize("config, body, param, limit", [
    ({"stage_overrides": {"1": {"max_tokens_limit": 512}}}, {"sampling_params_list": UPSTREAM_LIST},
     "sampling_params_list[1].max_tokens", 512),
    ({"cli_args": {"max_tokens_limit": 1024}}, {"sampling_params_list": UPSTREAM_LIST},
     "sampling_params_list[0].max_tokens", 1024),
    ({"cli_args": {"max_tokens_limit": 1024}}, {"max_tokens": 2000}, "max_tokens", 1024),
])
def test_an_explicit_cap_guards_the_stage(config, body, param, limit):
    with pytest.raises(APIError) as info:
        resolve(body, **config)
    assert info.value.status == 400 and info.value.param == param
    assert f"at most {limit} tokens (the server's max_tokens_limit for this stage)" in info.value.message


def test_the_standard_max_tokens_must_fit_the_context():
    params = resolve({"max_tokens": 16384})
    assert params[0].max_tokens == 16384 and params[0]._max_tokens_must_fit
    assert not params[1]._max_tokens_must_fit


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model("qwen3")), device="cpu", max_model_len=32, num_kv_blocks=8,
                                  block_size=16, enforce_eager=True))


def test_engine_answers_a_request_max_tokens_over_the_context_as_vllm(engine):
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True).clone(_max_tokens_must_fit=True)
    out = engine.add_request("too-long", list(range(3, 13)), params)
    message = out.error
    assert message == ("'max_tokens' or 'max_completion_tokens' is too large: 25. This model's maximum context "
                       "length is 32 tokens and your request has 10 input tokens (25 > 32 - 10).")
    api = from_request_failure(0, message, [])
    assert (api.status, api.param) == (400, "max_tokens")


def test_engine_runs_any_other_max_tokens_up_to_the_context(engine):
    assert engine.add_request("bounded", list(range(3, 13)), SamplingParams(max_tokens=25, temperature=0.0,
                                                                            ignore_eos=True)) is None
    done = None
    while done is None:
        done = next((o for o in engine.step() if o.finished), None)
    assert len(done.outputs[0].token_ids) == 32 - 10 and done.outputs[0].finish_reason == "length"
