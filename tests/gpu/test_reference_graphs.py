"""A cloned voice's reference encoders replayed from their CUDA graphs (reference_graphs.py)
against the encoders run eagerly on the unpadded reference: the speaker row within float
rounding, Mimi's codes equal, for references of several lengths (whole frames or not, in
several buckets); a reference longer than the largest bucket runs eagerly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.reference_graphs import BUCKET_SECONDS  # noqa: E402


def voice(seconds: float) -> torch.Tensor:
    t = np.arange(int(seconds * 24000)) / 24000
    f0 = 140 + 12 * np.sin(2 * np.pi * 3 * t)
    return torch.from_numpy((0.4 * np.sin(2 * np.pi * f0 * t) + 0.1 * np.sin(4 * np.pi * f0 * t)).astype("float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_graphs_encode_as_the_eager_encoders(tiny_model, dtype):
    path = tiny_model("qwen3_tts", task_type="Base")
    engine = LLMEngine(EngineConfig(model=str(path), model_stage="talker", device="cuda", dtype=dtype,
                                    architecture="Qwen3TTSForConditionalGeneration", enable_prefix_caching=False,
                                    max_num_seqs=4, gpu_memory_utilization=0.1))
    model = engine.model
    graphs = model.reference_graphs
    assert graphs is not None, "a Base talker on CUDA captures its reference encoders' graphs at load"
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for seconds in (1.0, 1.37, 2.0, 4.81, 11.3, BUCKET_SECONDS[-1]):
        audio = voice(seconds)
        row, codes = graphs.embed_speaker(audio), graphs.encode_codes(audio)
        eager_row, eager_codes = model.speaker_encoder.embed(audio), model.speech_encoder.encode(audio)
        torch.testing.assert_close(row, eager_row, rtol=tolerance, atol=tolerance * float(eager_row.abs().max()))
        if dtype == "float32":
            assert torch.equal(codes, eager_codes), seconds
        else:  # bf16 convolutions of other lengths round differently; a near tie may pick another code
            assert codes.shape == eager_codes.shape and (codes == eager_codes).float().mean() > 0.95, seconds
    too_long = voice(BUCKET_SECONDS[-1] + 0.5)
    assert graphs.embed_speaker(too_long) is None and graphs.encode_codes(too_long) is None
    # the talker's own path falls back to the eager encoders for it
    assert torch.equal(model._encode_reference_codes(too_long), model.speech_encoder.encode(too_long))
