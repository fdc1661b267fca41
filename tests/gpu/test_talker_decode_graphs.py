"""The talkers' decode steps in CUDA graphs against their eager steps (runs only where CUDA is):
the batched input rows (`embed_request_spans`), M-RoPE positions from `decode_positions`, the
staged graph inputs and the penalty state kept on the device, with requests of different
lengths sharing the batch buckets.

Qwen2.5-Omni's talker in float32: identical codes. Qwen3-Omni's MoE talker captures only in
bf16 (grouped-GEMM experts): greedy paths agree until a near-tie, with close logprobs; its code
predictor's graphs are captured at load with the others (an eager engine runs it eagerly)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.layers.moe import grouped_mm_available  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.testing.engine_runs import EngineRun  # noqa: E402
from vllm_omni.testing.talker_inputs import chat_prompt_ids, talker_prompt  # noqa: E402

STEPS = 40


def run_talker(path, family: str, dtype: str, eager: bool) -> dict:
    eng = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype=dtype,
                                 enforce_eager=eager, enable_prefix_caching=False, max_num_seqs=8))
    assert (eng.runner.graphs is None) == eager
    predictor = getattr(eng.model, "graphed_predictor", None)  # Qwen3-Omni's: captured at load, not while serving
    assert predictor is None or (predictor.graphs is None) == eager
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, repetition_penalty=1.3,
                            logprobs=0, detokenize=False)
    run = EngineRun(eng)
    for i, (words, reply) in enumerate([(3, 4), (9, 12), (20, 30)]):  # three lengths in one batch
        prompt = talker_prompt(eng.model, family, chat_prompt_ids(str(path), words), reply, seed=i)
        run.add(str(i), prompt["prompt_token_ids"], params, model_inputs=prompt["additional_information"])
    return {rid: out.outputs[0] for rid, out in run.run().items()}


def test_qwen2_5_talker_graphs_give_the_eager_codes(tiny_model):
    path = tiny_model("qwen2_5_omni")
    graphed = run_talker(path, "qwen2_5_omni", "float32", eager=False)
    eager = run_talker(path, "qwen2_5_omni", "float32", eager=True)
    for key, want in eager.items():
        assert len(want.token_ids) == STEPS
        assert graphed[key].token_ids == want.token_ids, key


def test_qwen3_talker_graphs_follow_the_eager_path(tiny_model):
    if not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model("qwen3_omni_moe")
    graphed = run_talker(path, "qwen3_omni", "bfloat16", eager=False)
    eager = run_talker(path, "qwen3_omni", "bfloat16", eager=True)
    for key, want in eager.items():
        got = graphed[key]
        for step, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            assert abs(got.logprobs[step][a] - want.logprobs[step][b]) < 5e-2, (key, step)
            if a != b:
                break
        assert got.token_ids[0] == want.token_ids[0]
