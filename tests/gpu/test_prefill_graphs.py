"""Prefill spans in CUDA graphs (core/prefill_graphs.py) against the same engine with prefills
run eagerly (runs only where CUDA is). Decode steps replay their graphs in both runs, so the
prefill is the only difference: one request alone, requests arriving while others decode (a
step of decode rows through the decode graph plus one prefill through a prefill graph), and
requests arriving together (their spans packed into one prefill graph).

bfloat16 (FlashAttention prefill; a padded span changes the GEMMs' shapes, so sums may round
differently): the first code of every request is identical, logprobs agree within 5e-2, and
greedy codes agree until a near-tie."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni import envs  # noqa: E402
from vllm_omni.model_executor.layers.moe import grouped_mm_available  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.testing.engine_runs import EngineRun  # noqa: E402
from vllm_omni.testing.talker_inputs import chat_prompt_ids, talker_prompt  # noqa: E402

STEPS = 12
TTS_TEXTS = ["Hi.", "The weather is nice today, so we are going to the park.",
             "Once upon a time there was a little girl who lived in a village near the forest, and every "
             "morning she walked to the river to fetch water for her grandmother."]


def tts_prompts(path) -> list[dict]:
    from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor

    processor = Qwen3TTSInputProcessor(path)
    return [processor.process({"prompt": text, "speaker": processor.speakers[0]}) for text in TTS_TEXTS]


def omni_prompts(path, family: str):
    def build(engine):
        return [talker_prompt(engine.model, family, chat_prompt_ids(str(path), words), reply, seed=i)
                for i, (words, reply) in enumerate([(3, 4), (9, 12), (40, 30)])]
    return build


ARRIVALS = ["alone", "arriving-under-decode", "arriving-together"]


def run(path, prompts, monkeypatch, graphs: bool, arrival: str, **config) -> tuple[dict, list]:
    """Greedy codes with logprobs per request, and the steps that replayed a prefill graph as
    (decode rows, prefill spans) each."""
    monkeypatch.setenv(envs.PREFILL_CUDA_GRAPHS.name, "1" if graphs else "0")
    eng = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="bfloat16",
                                 enable_prefix_caching=False, max_num_seqs=8, **config))
    assert (eng.runner.prefill_graphs is not None) == graphs
    prefill_steps = []
    replay_graphs = eng.runner._replay_graphs

    def recorded(items, previous):
        replayed = replay_graphs(items, previous)
        spans = sum(item.num_new_tokens > 1 for item in items)
        if replayed is not None and spans:
            prefill_steps.append((len(items) - spans, spans))
        return replayed
    eng.runner._replay_graphs = recorded
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0, detokenize=False)
    done, run = {}, EngineRun(eng)

    def step_until_done():
        while eng.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0]) for o in run.step())

    for i, prompt in enumerate(prompts(eng) if callable(prompts) else prompts):
        run.add(str(i), prompt["prompt_token_ids"], params, model_inputs=prompt["additional_information"])
        if arrival == "arriving-under-decode":  # the next request arrives while this one decodes
            for _ in range(3):
                done.update((o.request_id, o.outputs[0]) for o in run.step())
        elif arrival == "alone":
            step_until_done()
    step_until_done()
    return done, prefill_steps


def assert_follows(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, ref in want.items():
        out = got[key]
        assert len(out.token_ids) == len(ref.token_ids) == STEPS
        assert out.token_ids[0] == ref.token_ids[0], key
        for step, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)):
            assert abs(out.logprobs[step][a] - ref.logprobs[step][b]) < 5e-2, (key, step)
            if a != b:
                break


# (decode rows, prefill spans) of the steps that replayed a prefill graph, for three requests
EXPECTED_PREFILL_STEPS = {"alone": [(0, 1)] * 3, "arriving-under-decode": [(0, 1), (1, 1), (2, 1)],
                          "arriving-together": [(0, 3)]}


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_tts_talker_prefill_graphs_follow_eager_prefills(tmp_path, monkeypatch, arrival):
    from vllm_omni.testing.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_tts", tmp_path / "tts", task_type="CustomVoice")
    prompts = tts_prompts(path)
    config = dict(architecture="Qwen3TTSForConditionalGeneration")
    graphed, prefill_steps = run(path, prompts, monkeypatch, graphs=True, arrival=arrival, **config)
    eager, eager_steps = run(path, prompts, monkeypatch, graphs=False, arrival=arrival, **config)
    assert prefill_steps == EXPECTED_PREFILL_STEPS[arrival] and not eager_steps
    assert_follows(graphed, eager)


@pytest.mark.parametrize("arrival", ARRIVALS[1:])
@pytest.mark.parametrize("family,arch", [("qwen2_5_omni", "qwen2_5_omni"), ("qwen3_omni", "qwen3_omni_moe")])
def test_omni_talker_prefill_graphs_follow_eager_prefills(tiny_model, monkeypatch, family, arch, arrival):
    if arch == "qwen3_omni_moe" and not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model(arch)
    graphed, prefill_steps = run(path, omni_prompts(path, family), monkeypatch, graphs=True, arrival=arrival)
    eager, _ = run(path, omni_prompts(path, family), monkeypatch, graphs=False, arrival=arrival)
    assert prefill_steps == EXPECTED_PREFILL_STEPS[arrival]
    assert_follows(graphed, eager)


def test_float32_prefills_run_eagerly(tmp_path):
    """float32 prefills take the torch reference path (no FlashAttention kernel): no prefill graphs."""
    from vllm_omni.testing.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_tts", tmp_path / "tts", task_type="CustomVoice")
    eng = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="float32",
                                 architecture="Qwen3TTSForConditionalGeneration", max_num_seqs=4))
    assert eng.runner.graphs is not None and eng.runner.prefill_graphs is None


@pytest.mark.parametrize("together", [False, True], ids=["arriving-under-decode", "arriving-together"])
@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_thinker_prefill_graphs_follow_eager_prefills(tiny_model, monkeypatch, arch, together):
    """Text prompts: the thinker's tokens and the hidden states it exports to the talker."""
    if arch == "qwen3_omni_moe" and not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model(arch)
    results = []
    for graphs in (True, False):
        monkeypatch.setenv(envs.PREFILL_CUDA_GRAPHS.name, "1" if graphs else "0")
        eng = LLMEngine(EngineConfig(model=str(path), model_stage="thinker", device="cuda", dtype="bfloat16",
                                     enable_prefix_caching=False, max_num_seqs=8, hidden_state_layers=(0, 1)))
        assert (eng.runner.prefill_graphs is not None) == graphs
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0, detokenize=False)
        done, run = {}, EngineRun(eng)
        for i, words in enumerate([3, 25, 60]):
            run.add(str(i), chat_prompt_ids(str(path), words), params, return_hidden_states=True)
            for _ in range(0 if together else 3):  # the next request arrives while this one decodes
                done.update((o.request_id, o) for o in run.step())
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in run.step())
        results.append(done)
    graphed, eager = results
    assert_follows({k: v.outputs[0] for k, v in graphed.items()}, {k: v.outputs[0] for k, v in eager.items()})
    for key, ref in eager.items():
        assert ref.outputs[0].multimodal_output.keys() == {"0", "1", "last"}
        for layer, want in ref.outputs[0].multimodal_output.items():
            got = graphed[key].outputs[0].multimodal_output[layer]
            prompt = len(ref.prompt_token_ids)  # the prefill's rows (later rows follow the tokens)
            torch.testing.assert_close(got[:prompt].float(), want[:prompt].float(), atol=3e-2, rtol=3e-2)
