"""Tensor parallel on two CUDA devices (NCCL): TP=2 against TP=1 in float32, memory split
between the GPUs, a killed rank failing the engine promptly. Skipped without 2 GPUs.

    pytest -q tests/gpu/test_tensor_parallel.py     # on a machine with >= 2 GPUs

TP=1 keeps its CUDA graphs; TP=2 runs eagerly (collectives are not captured).
"""
from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

from tests.core.test_llm_vs_hf import make_prompts  # noqa: E402
from tests.parallel.test_tp_thinkers import FAMILIES, run_batch  # noqa: E402
from vllm_omni import LLM, SamplingParams  # noqa: E402
from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.core.tp_executor import TensorParallelError  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Big enough for real kernels (Triton attention, grouped-GEMM MoE in bf16), small enough to build fast.
MEDIUM = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4)
ARCHS = {
    "qwen2": MEDIUM,
    "qwen3": MEDIUM | {"head_dim": 64},
    "qwen3_moe": MEDIUM | {"head_dim": 64, "moe_intermediate_size": 256, "num_experts": 8},
}


def release_gpu_memory() -> None:
    gc.collect()  # CUDA graphs and KV caches go with the engine's last reference
    torch.cuda.empty_cache()


def tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tp2_equals_tp1_float32(arch, tiny_model):
    path = str(tiny_model(arch, **ARCHS[arch]))
    prompts = make_prompts(512)
    tp1 = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    assert tp1.engine.runner.graphs is not None or arch == "qwen3_moe"  # TP=1 keeps CUDA graphs
    expected = tokens(tp1, prompts)
    del tp1
    release_gpu_memory()
    tp2 = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        assert tokens(tp2, prompts) == expected
    finally:
        tp2.engine.runner.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_thinker_tp2_equals_tp1_float32(family, tiny_model):
    path = str(tiny_model(family))
    make_prompt, kinds = FAMILIES[family]

    def thinker(tp: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=path, model_stage="thinker", device="cuda", dtype="float32",
                                      gpu_memory_utilization=0.2, tensor_parallel_size=tp))

    tp1 = thinker(1)
    requests = {kind: make_prompt(tp1.tokenizer, kind) for kind in kinds}
    expected = {k: o.outputs[0].token_ids for k, o in run_batch(tp1, requests).items()}
    del tp1
    release_gpu_memory()
    tp2 = thinker(2)
    try:
        assert {k: o.outputs[0].token_ids for k, o in run_batch(tp2, requests).items()} == expected
    finally:
        tp2.runner.close()


def test_each_gpu_holds_its_half(tiny_model):
    path = str(tiny_model("qwen3", **ARCHS["qwen3"]))
    free_before = torch.cuda.mem_get_info(1)[0]
    tp2 = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        model = tp2.engine.model
        assert next(model.parameters()).device == torch.device("cuda", 0)
        sharded = model.model.layers[0].mlp.down_proj.weight
        assert sharded.shape == (512, 512)  # intermediate 1024 split over 2 ranks
        # Rank 1 allocated its shard and a KV cache of the same size on the second GPU.
        used_on_1 = free_before - torch.cuda.mem_get_info(1)[0]
        assert used_on_1 > 0.2 * torch.cuda.get_device_properties(1).total_memory
        assert len(tokens(tp2, [[5, 6, 7]])[0]) == GREEDY.max_tokens
    finally:
        tp2.engine.runner.close()


def test_killed_rank_fails_the_engine_promptly_on_nccl(tiny_model):
    tp2 = LLM(str(tiny_model("qwen3", **ARCHS["qwen3"])), device="cuda", gpu_memory_utilization=0.3,
              tensor_parallel_size=2)
    engine = tp2.engine
    try:
        engine.add_request("long", list(range(5, 40)), SamplingParams(max_tokens=2000, ignore_eos=True))
        engine.step()
        os.kill(engine.runner.ranks.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(2000):
                engine.step()
        assert time.monotonic() - start < 60  # NCCL waits on a dead peer until the group is aborted
    finally:
        engine.runner.close()
