"""Greedy ids equal transformers' on configurations unlike the default tiny ones:
other widths, head dims, GQA ratios, biases, MoE routing variants, rope theta."""
from __future__ import annotations

import pytest
import torch

from vllm_omni import LLM, SamplingParams

from .test_llm_vs_hf import hf_greedy, make_prompts

CONFIGS = {
    "qwen2_wide_tied": ("qwen2", dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_mha_theta": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0)),
    "qwen3_bias_headdim32": ("qwen3", dict(head_dim=32, num_attention_heads=8, num_key_value_heads=1,
                                           attention_bias=True, tie_word_embeddings=False)),
    "qwen3_moe_top1_unnormalized": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=1, norm_topk_prob=False,
                                                      num_hidden_layers=3, decoder_sparse_step=2)),
    "qwen3_moe_dense_first": ("qwen3_moe", dict(mlp_only_layers=[0], num_experts_per_tok=3, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers_on_other_configs(tiny_model, name):
    arch, overrides = CONFIGS[name]
    path = str(tiny_model(arch, seed=3, **overrides))
    prompts = make_prompts(300, [5, 16, 17, 31, 40, 9], seed=4)
    expected = [hf_greedy(path, p, 10) for p in prompts]
    llm = LLM(path, max_num_batched_tokens=24)  # chunked prefill as well
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
