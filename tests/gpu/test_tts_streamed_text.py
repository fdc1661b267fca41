"""Qwen3-TTS on CUDA (the talker's prefill and decode graphs, float32) with the inputs that do
not come whole with the request: text that streams in while the talker waits for it gives the
codes of the whole text at once (as on the CPU: tests/models/test_qwen3_tts_stored_text.py),
alone and beside other requests; a stored voice speaks with the talker running no encoder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder  # noqa: E402
from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor, load_reference_audio  # noqa: E402
from tests.models.test_qwen3_tts_stored_text import TEXT, WORDS, long_greedy  # noqa: E402


def cuda_engine(path) -> LLMEngine:
    torch.backends.cuda.matmul.allow_tf32 = False
    return LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype="float32",
                                  architecture="Qwen3TTSForConditionalGeneration", enable_prefix_caching=False,
                                  max_num_seqs=4, gpu_memory_utilization=0.1, enforce_eager=False))


def run(engine, requests: dict, appends: dict[str, list[str]], processor, every: int = 5) -> dict[str, list]:
    for rid, (prompt, complete) in requests.items():
        assert engine.add_request(rid, prompt["prompt_token_ids"], long_greedy(),
                                  model_inputs=prompt["additional_information"], input_complete=complete) is None
    done: dict[str, list] = {}
    for step in range(1, 1000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].multimodal_output[CODES_KEY].tolist()
        if len(done) == len(requests):
            return done
        if step % every == 0:
            for rid, rest in appends.items():
                if rest:
                    engine.append_inputs(rid, processor.process_delta({"prompt": rest.pop(0)}), final=not rest)
    raise AssertionError("the requests did not finish")


def test_streamed_text_on_cuda_speaks_as_the_whole_text(tiny_model):
    path = tiny_model("qwen3_tts", task_type="CustomVoice")
    engine = cuda_engine(path)
    processor = Qwen3TTSInputProcessor(path, engine.tokenizer)
    options = {"speaker": "vivian", "language": "english", "non_streaming_mode": False}
    whole = processor.process({**options, "prompt": "".join(TEXT)})
    streamed = processor.process({**options, "prompt": WORDS[0], "text_complete": False})
    other = processor.process({"speaker": "ryan", "prompt": "Someone else speaks meanwhile."})
    alone = run(engine, {"w": (whole, True)}, {}, processor)
    together = run(engine, {"s": (streamed, False), "o": (other, True)}, {"s": list(WORDS[1:])}, processor)
    assert together["s"] == alone["w"]


def test_a_stored_voice_on_cuda_runs_no_encoder(tiny_model, monkeypatch):
    path = tiny_model("qwen3_tts", task_type="Base")
    engine = cuda_engine(path)
    model = engine.model
    monkeypatch.setattr(model.reference_cache, "_embed_speaker", lambda audio: pytest.fail("the encoder ran"))
    processor = Qwen3TTSInputProcessor(path, engine.tokenizer)
    t = np.arange(24000) / 24000
    audio = load_reference_audio(((0.4 * np.sin(2 * np.pi * 150 * t)).astype("float32"), 24000))
    voice = VoiceEncoder.load(path).encode(audio, "Hello there.")
    prompt = processor.process({"prompt": "Nice to meet you.", "cloned_voice": voice})
    codes = run(engine, {"v": (prompt, True)}, {}, processor)["v"]
    assert len(codes) == 48
