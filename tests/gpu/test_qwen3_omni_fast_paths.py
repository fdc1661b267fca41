"""Qwen3-Omni's fast paths on CUDA against their eager paths (runs only where CUDA is):
the MoE thinker's decode in CUDA graphs (bf16: the grouped-GEMM experts are what makes it
capturable), and the code predictor's frame graphs of both talkers and its fused attention
kernel (float32: identical codes)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.layers.moe import grouped_mm_available  # noqa: E402
from vllm_omni.model_executor.models.predictor_graphs import PredictorFrame, PredictorGraphs  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402

from ..core.test_llm_vs_hf import make_prompts  # noqa: E402


def engine(path, stage: str, dtype: str, eager: bool, architecture: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), model_stage=stage, architecture=architecture, device="cuda",
                                  dtype=dtype, enforce_eager=eager, enable_prefix_caching=False))


def greedy_with_logprobs(eng: LLMEngine, prompts: list[list[int]], steps: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def test_moe_thinker_decodes_in_graphs_like_eager(tiny_model):
    if not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model("qwen3_omni_moe")
    fast = engine(path, "thinker", "bfloat16", eager=False)
    assert fast.runner.graphs is not None, "the MoE thinker must capture its decode graphs"
    prompts = make_prompts(200, [5, 17, 40])
    got = greedy_with_logprobs(fast, prompts, 8)
    ref = greedy_with_logprobs(engine(path, "thinker", "bfloat16", eager=True), prompts, 8)
    for key, want in ref.items():
        # bf16 greedy paths may part after a near-tie; until they do, the logprobs agree.
        for step, (a, b) in enumerate(zip(got[key].token_ids, want.token_ids)):
            assert abs(got[key].logprobs[step][a] - want.logprobs[step][b]) < 5e-2, (key, step)
            if a != b:
                break
        assert got[key].token_ids[0] == want.token_ids[0]


@pytest.mark.parametrize("family, architecture", [
    ("qwen3_omni_moe", "Qwen3OmniMoeForConditionalGeneration"), ("qwen3_tts", "Qwen3TTSForConditionalGeneration")])
def test_predictor_frame_graphs_give_the_eager_codes(tiny_model, family, architecture):
    talker = engine(tiny_model(family), "talker", "float32", eager=True, architecture=architecture).model
    graphed = talker.graphed_predictor
    rows = 3
    hidden = torch.randn(rows, graphed.width, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    first = talker.model.embed_tokens(torch.tensor([3, 11, 20], device="cuda"))
    with torch.inference_mode():
        eager_codes, eager_embeds = graphed.predictor(hidden, first, lambda logits, group: logits.argmax(dim=-1))
        graphs = PredictorGraphs(PredictorFrame(graphed.predictor, 4, graphed.width, graphed.vocab,
                                                graphed.sampling, hidden.device, hidden.dtype), 4)
        graphs.capture()
        codes, embeds = graphs.run(hidden, first, [True] * rows, [None] * rows)
        for attn in graphed.predictor.attention:  # each layer's torch ops instead of its fused kernel
            attn._attend_fused = attn._attend
        torch_codes, torch_embeds = graphed.predictor(hidden, first, lambda logits, group: logits.argmax(dim=-1))
    assert torch.equal(codes, eager_codes)
    torch.testing.assert_close(embeds, eager_embeds)
    assert torch.equal(eager_codes, torch_codes)
    torch.testing.assert_close(eager_embeds, torch_embeds)
