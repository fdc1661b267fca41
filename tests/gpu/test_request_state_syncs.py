"""A talker builds a request's state (its prompt rows: the thinker's states projected, a voice,
a cloned voice's reference encoded) between or inside its steps, on a GPU that the other stages
keep busy. A host wait there stalls the whole stage: on the H200, Qwen3-Omni's talker at 32 new
requests spent ~15 ms on each request's waits, 0.48 s before its first step. Nothing of it may
wait for the GPU (torch.cuda.set_sync_debug_mode; the failure lists each wait's stack)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.layers.moe import grouped_mm_available  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.testing.cuda_syncs import format_syncs, trace_syncs  # noqa: E402
from vllm_omni.testing.talker_inputs import chat_prompt_ids, talker_prompt  # noqa: E402

PARAMS = SamplingParams(temperature=0.9, top_k=50, max_tokens=8, seed=3, detokenize=False)


def busy_gpu() -> None:
    """Queue GPU work that a waiting call would have to sit out."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x
        x /= x.norm()


def assert_no_waits(run) -> None:
    busy_gpu()
    syncs = trace_syncs(run)
    assert not syncs, "the host waited for the GPU:\n" + format_syncs(syncs)


def run_to_the_end(engine: LLMEngine) -> None:
    """The requests still run to their ends (a bounded loop: a hang fails the test)."""
    for _ in range(4 * PARAMS.max_tokens + 8):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("family,arch", [("qwen2_5_omni", "qwen2_5_omni"), ("qwen3_omni", "qwen3_omni_moe")])
def test_a_streamed_omni_talker_request_starts_without_waiting(tiny_model, family, arch):
    if arch == "qwen3_omni_moe" and not grouped_mm_available(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm needs Hopper")
    path = tiny_model(arch)
    engine = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="bfloat16",
                                    enable_prefix_caching=False, max_num_seqs=4, gpu_memory_utilization=0.1))
    prompt_ids = chat_prompt_ids(str(path), 9)
    prompts = [talker_prompt(engine.model, family, prompt_ids, reply_rows=1, seed=i) for i in range(2)]
    keys = ("thinker_embeds", "thinker_hidden")
    width = prompts[0]["additional_information"]["thinker_embeds"].shape[1]

    def start(i: int) -> None:  # the bridge's first message, then one streamed reply row
        prompt = prompts[i]
        engine.add_request(str(i), prompt["prompt_token_ids"], PARAMS, model_inputs=prompt["additional_information"],
                           stream=True, input_complete=False)
        engine.append_inputs(str(i), {key: torch.randn(1, width) for key in keys}, final=False)

    start(0)  # warm-up: pinned staging memory, kernels
    assert_no_waits(lambda: start(1))
    for rid in ("0", "1"):
        engine.append_inputs(rid, {}, final=True)
    run_to_the_end(engine)


@pytest.mark.parametrize("task", ["CustomVoice", "Base"])
def test_a_tts_request_state_is_built_without_waiting(tmp_path, task):
    from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor
    from vllm_omni.testing.tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_tts", tmp_path / task, task_type=task)
    engine = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="bfloat16",
                                    architecture="Qwen3TTSForConditionalGeneration", enable_prefix_caching=False,
                                    max_num_seqs=4, gpu_memory_utilization=0.1))
    processor = Qwen3TTSInputProcessor(path)
    t = np.arange(24000) / 24000

    def voice(i: int) -> dict:  # a reference of its own for each request: not one the talker has encoded
        if task == "CustomVoice":
            return {"speaker": processor.speakers[0]}
        return {"ref_audio": ((0.3 * np.sin(2 * np.pi * (140 + i) * t)).astype("float32"), 24000),
                "ref_text": "Hello there."}

    def add(i: int):
        prompt = processor.process({"prompt": "The weather is nice today.", **voice(i)})
        engine.add_request(str(i), prompt["prompt_token_ids"], PARAMS, model_inputs=prompt["additional_information"])
        request = engine.scheduler.requests[str(i)]
        return lambda: engine.model.embed_request_span(request, 0, request.num_prompt_tokens, None)

    add(0)()  # warm-up
    # the prefill's rows: the speaker, the reference encoded (through its encoders' graphs; the
    # eager transformers MimiModel.encode would wait once inside its own code), the text
    assert_no_waits(add(1))
    run_to_the_end(engine)
