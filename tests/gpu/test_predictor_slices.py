"""A code predictor's frame for more rows than its largest graph: replayed in slices, with the
eager predictor's codes (issue 44: past 64 rows the eager frame slowed a TTS talker's steps
several times over, and a server under Poisson arrivals fell behind for good)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.models.predictor_graphs import MAX_GRAPH_BATCH  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402


def test_a_batch_over_the_largest_graph_replays_slices_with_the_eager_codes(tiny_model):
    talker = LLMEngine(EngineConfig(model=str(tiny_model("qwen3_tts")), model_stage="talker", device="cuda",
                                    dtype="float32", enforce_eager=False, enable_prefix_caching=False,
                                    architecture="Qwen3TTSForConditionalGeneration")).model
    graphed = talker.graphed_predictor
    assert graphed.graphs is not None, "the talker must capture its predictor graphs"
    rows = MAX_GRAPH_BATCH + 7
    g = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(rows, graphed.width, device="cuda", generator=g)
    first = talker.model.embed_tokens(torch.randint(0, 20, (rows,), device="cuda", generator=g))
    graphed._greedy_rows = lambda requests: [True] * len(requests)  # whatever the checkpoint's predictor sampling
    request = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0), generator=None)
    with torch.inference_mode():
        codes, embeds = graphed.predict([request] * rows, hidden, first)
        eager_codes, eager_embeds = graphed.predictor(hidden, first, lambda logits, group: logits.argmax(dim=-1))
    assert codes.shape[0] == rows and torch.equal(codes, eager_codes)
    torch.testing.assert_close(embeds, eager_embeds)
