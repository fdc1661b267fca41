"""A stage's subtalker_sampling_params on CUDA, where the code predictor runs as captured graphs
(runs only where CUDA is): the settings reach the graphs (they are baked in at capture), greedy
settings give the eager codes, sampled ones are reproducible per seed."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.test_qwen3_tts import case_prompt, greedy, run_talker  # noqa: E402
from tests.reference.qwen_tts.cases import CASES, SEED  # noqa: E402
from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY  # noqa: E402
from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor  # noqa: E402


def codes(ckpt, settings: dict, params: dict, eager: bool) -> dict:
    engine = LLMEngine(EngineConfig(model=str(ckpt), model_stage="talker", device="cuda", dtype="float32",
                                    architecture="Qwen3TTSForConditionalGeneration", enforce_eager=eager,
                                    predictor_sampling=tuple(settings.items())))
    predictor = engine.model.graphed_predictor
    assert (predictor.graphs is None) == eager
    if not eager:
        assert predictor.graphs.frame.temperature == settings.get("temperature", 0.9)
    prompt = Qwen3TTSInputProcessor(ckpt, engine.tokenizer).process(case_prompt("CustomVoice",
                                                                                CASES["CustomVoice"][0]))
    out = run_talker(engine, {rid: prompt for rid in params}, params)
    return {rid: o.outputs[0].multimodal_output[CODES_KEY].tolist() for rid, o in out.items()}


def test_subtalker_settings_reach_the_predictor_graphs(tiny_model):
    ckpt = tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")
    off = {"do_sample": False, "temperature": 0.7}
    assert codes(ckpt, off, {"g": greedy()}, eager=False) == codes(ckpt, off, {"g": greedy()}, eager=True)
    on = {"do_sample": True, "temperature": 1.0, "top_k": 0}
    seeded = {rid: greedy().clone(seed=s, max_tokens=6) for rid, s in (("a", 1), ("b", 1), ("c", 2))}
    sampled = codes(ckpt, on, seeded, eager=False)
    assert sampled["a"] == sampled["b"] != sampled["c"]
