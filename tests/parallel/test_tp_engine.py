"""TP=2 against TP=1 through the engine (`LLM`), CPU and gloo: greedy tokens identical for the
tiny qwen2, qwen3 (tied embeddings) and qwen3_moe checkpoints, batched requests of lengths
across KV block boundaries; chunked prefill, preemption and prefix-cache hits at TP=2; KV
heads replicated when there are fewer than ranks."""
from __future__ import annotations

import pytest

from tests.core.test_llm_vs_hf import make_prompts
from vllm_omni import LLM, SamplingParams

ARCHS = ["qwen2", "qwen3", "qwen3_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tp2_engines():
    """LLMs to close when the module is done: each holds a rank process."""
    llms: list[LLM] = []
    yield llms
    for llm in llms:
        llm.engine.runner.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1(arch, tiny_model, tp2_engines):
    path = str(tiny_model(arch))
    prompts = make_prompts(512)  # 7 prompts of 3..50 tokens, run as one batch
    expected = token_ids(LLM(path), prompts)
    tp2 = LLM(path, tensor_parallel_size=2)
    tp2_engines.append(tp2)
    # Rank 0 holds half of every sharded tensor: the split really happened.
    attn = tp2.engine.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert tp2.engine.model.model.embed_tokens.weight.shape[0] == tp2.engine.hf_config.vocab_size // 2
    assert token_ids(tp2, prompts) == expected


def test_tp2_chunked_prefill_preemption_prefix_cache_replicated_kv(tiny_model, tp2_engines):
    # One KV head for two ranks: each rank holds a copy. 9 blocks cannot hold the 7 prompts
    # (preemption); a 32-token budget cuts the longer prompts into chunks.
    path = str(tiny_model("qwen2", num_key_value_heads=1))
    prompts = make_prompts(512)
    expected = token_ids(LLM(path), prompts)
    engine_args = dict(max_num_batched_tokens=32, num_kv_blocks=9, max_model_len=64)
    tp2 = LLM(path, tensor_parallel_size=2, **engine_args)
    tp2_engines.append(tp2)
    assert tp2.engine.model.model.layers[0].self_attn.num_kv_heads == 1
    preempted = []
    schedule = tp2.engine.scheduler.schedule
    tp2.engine.scheduler.schedule = lambda: (out := schedule(), preempted.extend(out.preempted))[0]
    assert token_ids(tp2, prompts) == expected
    assert preempted

    shared = prompts[5][:32]  # 2 full blocks: later requests find them in the prefix cache
    with_prefix = [shared + p for p in prompts[:3]]
    expected = token_ids(LLM(path), with_prefix)
    first = tp2.generate([{"prompt_token_ids": with_prefix[0]}], GREEDY, use_tqdm=False)
    rest = tp2.generate([{"prompt_token_ids": p} for p in with_prefix[1:]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert [o.num_cached_tokens for o in rest] == [32, 32]
