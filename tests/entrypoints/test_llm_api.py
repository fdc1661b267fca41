"""LLM API behaviour asserted directly: stop rules, seeds, prompt shapes, bad input."""
from __future__ import annotations

import json
import shutil

import pytest

from vllm_omni import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen3")))


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


PROMPT = "The quick brown fox jumps over the lazy dog"


def test_prompt_shapes_and_order(llm):
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    outs = llm.generate([PROMPT, {"prompt_token_ids": ids}, {"prompt": PROMPT}], greedy(), use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].prompt == PROMPT and outs[0].prompt_token_ids == ids
    assert all(o.finished for o in outs)
    single = llm.generate(PROMPT, greedy(), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_text_is_the_decoded_output(llm):
    out = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # A character left incomplete by the last token is not emitted (vLLM's rule).
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert len(out.token_ids) == 16 and out.finish_reason == "length"


def test_max_tokens(llm):
    for n in (1, 5):
        out = llm.generate(PROMPT, greedy(max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stop_token_ids(llm):
    base = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = base[4]
    first = base.index(stop)
    out = llm.generate(PROMPT, greedy(ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_a_stop_token_that_is_also_the_last_allowed_token_stops(llm):
    """vLLM's order: the stop token wins over the length limit it also reaches (a talker's EOS
    there is then dropped downstream, as every other EOS)."""
    base = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = base[4]
    first = base.index(stop)
    out = llm.generate(PROMPT, greedy(max_tokens=first + 1, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_excluded_and_included(llm):
    base = llm.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert len(base) > 12, base
    stop = base[6:9]
    cut = base.index(stop)
    out = llm.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(
        PROMPT, greedy(max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert out.text == base[: cut + len(stop)]


def test_ignore_eos(tiny_model, tmp_path):
    # A copy of the model whose EOS is a token it emits greedily, so EOS really happens.
    src = tiny_model("qwen3")
    probe = LLM(str(src)).generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    eos = probe[3]
    path = tmp_path / "eos_model"
    shutil.copytree(src, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path))
    stopped = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == probe[: probe.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignoring = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignoring.token_ids == probe and ignoring.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(llm, tiny_model):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
              greedy(ignore_eos=True)]
    prompts = ["a b c", PROMPT, "hello there world", PROMPT]
    batch = llm.generate(prompts, [others[0], others[1], others[2], seeded], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    fresh = LLM(str(tiny_model("qwen3")))
    assert fresh.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids == alone
    different = llm.generate(PROMPT, seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected


def test_prompt_longer_than_max_model_len_fails_alone(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), max_model_len=32)
    outs = llm.generate([{"prompt_token_ids": [5] * 40}, PROMPT], greedy(max_tokens=4), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "max_model_len=32" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) >= 1


def test_generation_stops_at_max_model_len(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), max_model_len=20)
    out = llm.generate({"prompt_token_ids": [5] * 15}, greedy(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
     ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
     ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1)],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
@pytest.mark.parametrize("value", [[1, "a"], [True], [1.5], "12", [3, -1], [2**63]])
def test_invalid_token_id_lists_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_token_id_lists_become_plain_ints():
    import numpy as np

    params = SamplingParams(stop_token_ids=(np.int64(7), 8), allowed_token_ids=iter(range(3)))
    assert params.stop_token_ids == [7, 8] and all(type(t) is int for t in params.stop_token_ids)
    assert params.allowed_token_ids == [0, 1, 2]


def test_unknown_architecture_names_supported_ones(tiny_model, tmp_path):
    path = tmp_path / "weird"
    shutil.copytree(tiny_model("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*Qwen3ForCausalLM|Qwen3ForCausalLM.*FancyNewForCausalLM"):
        LLM(str(path))


def test_invalid_engine_argument_is_named(tiny_model):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model("qwen3")), block_size=12)
