"""Our engine against transformers' `generate` on tiny random checkpoints (float32, CPU).

Every engine configuration that changes *how* tokens are computed (chunked prefill,
preemption, prefix-cache hits, one sequence at a time) must give the same greedy ids.
"""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_omni import LLM, SamplingParams

ARCHS = ["qwen2", "qwen3", "qwen3_moe"]
NEW_TOKENS = 12
# Lengths cross the 16-token block boundary in both directions; 50 spans 4 blocks.
PROMPT_LENGTHS = [3, 15, 16, 17, 33, 50, 7]


def make_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 300), (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], n: int, **kwargs) -> list[int]:
    model = hf_model(path)
    kwargs.setdefault("eos_token_id", None)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate() masks every prompt token equal to pad_token_id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tiny_model):
    path = str(tiny_model(request.param))
    vocab = hf_model(path).config.vocab_size
    prompts = make_prompts(vocab)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    return path, prompts, expected


def run(path, prompts, params, **engine_args):
    llm = LLM(path, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

ENGINE_VARIANTS = {
    "batched": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 9, "max_model_len": 64},  # 9 blocks cannot hold all 7 sequences
    "one_seq_at_a_time": {"max_num_seqs": 1},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(arch_model, variant):
    path, prompts, expected = arch_model
    llm, outs = run(path, prompts, GREEDY, **ENGINE_VARIANTS[variant])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(rc == 0 for rc in bm.ref_counts)


def test_preemption_actually_happens(arch_model):
    path, prompts, expected = arch_model
    llm = LLM(path, **ENGINE_VARIANTS["preemption"])
    preempted = []
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def spy():
        out = original()
        preempted.extend(out.preempted)
        return out

    scheduler.schedule = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert preempted
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_prefix_cache_hits_give_same_tokens(arch_model):
    path, prompts, _ = arch_model
    shared = prompts[5][:40]  # 2 full blocks of 16 + 8 tokens
    with_prefix = [shared + p for p in prompts[:4]]
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in with_prefix]
    llm = LLM(path)
    first = llm.generate([{"prompt_token_ids": with_prefix[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in with_prefix[1:]], GREEDY, use_tqdm=False)
    outs = first + rest
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [32, 32, 32]  # the 2 full shared blocks


def test_repetition_penalty_matches_transformers(arch_model):
    path, prompts, _ = arch_model
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.5)
    _, outs = run(path, prompts[:4], params)
    expected = [hf_greedy(path, p, NEW_TOKENS, repetition_penalty=1.5) for p in prompts[:4]]
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_min_tokens_matches_transformers_min_new_tokens(arch_model):
    path, prompts, expected = arch_model
    # Make the stop token one the model emits greedily at step 2, so min_tokens decides.
    for prompt, greedy in zip(prompts, expected):
        stop = greedy[1]
        if stop not in greedy[:1]:
            break
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=5, stop_token_ids=[stop])
    _, (out,) = run(path, [prompt], params)
    reference = hf_greedy(path, prompt, NEW_TOKENS, min_new_tokens=5, eos_token_id=stop)
    assert out.outputs[0].token_ids == reference
    _, (unconstrained,) = run(path, [prompt], params.clone(min_tokens=0))
    assert unconstrained.outputs[0].token_ids == greedy[:2]  # stops at the stop token without min_tokens
    assert unconstrained.outputs[0].stop_reason == stop


def test_logprobs_equal_reference_log_softmax(arch_model):
    path, prompts, expected = arch_model
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    _, outs = run(path, prompts[:3], params)
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1 :]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for step, (token, lps) in enumerate(zip(ids, out.outputs[0].logprobs)):
            assert token in lps and len(lps) in (3, 4)
            top3 = torch.topk(ref[step], 3).indices.tolist()
            assert set(top3) <= set(lps)
            for t, lp in lps.items():
                assert lp == pytest.approx(ref[step, t].item(), abs=1e-4)


def test_hidden_states_match_transformers(tiny_model):
    path = str(tiny_model("qwen3"))
    llm = LLM(path, hidden_state_layers=(0, 1, 2))
    prompt = make_prompts(300, [20])[0]
    engine = llm.engine
    engine.add_request("h", prompt, GREEDY.clone(max_tokens=5), return_hidden_states=True)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    out = final.outputs[0]
    seq = prompt + out.token_ids[:-1]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for layer in (0, 1, 2):
        got = out.multimodal_output[str(layer)]
        assert got.shape == (len(seq), ref[layer].shape[-1])
        torch.testing.assert_close(got, ref[layer][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.multimodal_output["last"], ref[-1][0], atol=1e-4, rtol=1e-4)
