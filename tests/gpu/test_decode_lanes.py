"""The code2wav engine's CUDA lanes (worker/decode_lanes.py) with the tiny Qwen3-TTS and
Qwen3-Omni code2wav and their graphs: a new stream's first chunk is decoded while later chunks
are still on the GPU (held there behind a sleep kernel), and every stream's audio is what the
engine gives with everything in order on one stream."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.code2wav_stream import Code2WavStreamConfig  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.stage_io import StageInputChunk, StageRequest  # noqa: E402
from vllm_omni.worker.decode_lanes import CudaLanes, HostLanes  # noqa: E402
from vllm_omni.worker.generation_stage_engine import GenerationStageEngine  # noqa: E402
from vllm_omni.worker.playback_deadlines import StreamDeadlines  # noqa: E402

FAMILIES = {"qwen3_tts": Qwen3TTSCode2Wav, "qwen3_omni_moe": Qwen3OmniMoeCode2Wav}
CONFIG = Code2WavStreamConfig(initial_chunk_frames=1, chunk_frames=6, left_context_frames=8)


def _open(engine, rid, frames):
    engine.add_request(StageRequest(request_id=rid, prompt_token_ids=[], sampling_params=SamplingParams(),
                                    input_complete=False))
    engine.add_input(StageInputChunk(request_id=rid, additional_information={"units": frames}, final=True))


def _record(outs, audio) -> list[str]:
    for out in outs:
        assert out.error is None, out.error
        audio.setdefault(out.request_id, []).append(out.multimodal_output["audio"])
    return [out.request_id for out in outs]


def _drain(engine, audio):
    while engine.has_work() or engine.poll_ms():
        _record(engine.step(), audio)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_chunks_do_not_wait_for_later_chunks_on_the_gpu(tiny_model, family):
    folder, cls = str(tiny_model(family)), FAMILIES[family]
    model = cls.load(folder, device="cuda", dtype="float32", stream_config=CONFIG, cuda_graphs=True)
    codec = getattr(model, "decoder", model)
    gen = torch.Generator().manual_seed(0)
    frames = {rid: torch.randint(0, codec.codebook_size, (n, codec.num_quantizers), generator=gen)
              for rid, n in (("a", 30), ("b", 23), ("c", 41), ("new", 17))}

    lanes = CudaLanes(torch.device("cuda"))
    # The tiny codecs' frames last well under a millisecond: a first-audio target below zero
    # stands for streams with more sound left than a new one's margin (its first chunk goes first).
    engine = GenerationStageEngine(model, OmniGenerationScheduler(8), stage_id=1, device="cuda", lanes=lanes,
                                   deadlines=StreamDeadlines(first_audio_target_s=-1.0))
    audio: dict[str, list[torch.Tensor]] = {}
    for rid in "abc":
        _open(engine, rid, frames[rid])
    assert sorted(_record(engine.step(), audio)) == ["a", "b", "c"]  # first chunks, at once
    decode = model.decode_streams

    def slow_later_chunks(decoders):  # the next launch stays on the GPU for ~1 s after its decode
        results = decode(decoders)
        torch.cuda._sleep(2_000_000_000)
        model.decode_streams = decode
        return results

    model.decode_streams = slow_later_chunks
    assert engine.step() == [] and not engine.has_work() and engine.poll_ms() == 1
    _open(engine, "new", frames["new"])
    assert _record(engine.step(), audio) == ["new"] and audio["new"][0].device.type == "cpu"
    assert engine.poll_ms() == 1 and not engine.has_work()  # the later chunks are still on the GPU
    _drain(engine, audio)

    # The same streams through an engine whose decodes all run in order.
    reference = GenerationStageEngine(cls.load(folder, device="cuda", dtype="float32", stream_config=CONFIG,
                                               cuda_graphs=True),
                                      OmniGenerationScheduler(8), stage_id=1, device="cuda", lanes=HostLanes())
    expected: dict[str, list[torch.Tensor]] = {}
    for rid in frames:
        _open(reference, rid, frames[rid])
    _drain(reference, expected)
    for rid in frames:
        torch.testing.assert_close(torch.cat(audio[rid]), torch.cat(expected[rid]), atol=1e-5, rtol=0)
    assert engine.stats()["num_unfinished"] == 0
