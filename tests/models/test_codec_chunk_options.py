"""Chunk options set on a deploy file's connector reach the code2wav stage of a running pipeline
(stages as threads, tiny Qwen3-TTS): `initial_codec_chunk_frames: 1, codec_chunk_frames: 3`
streams the first audio chunk after one talker frame and then chunks that grow to 3 frames
(code2wav_stream.py's ramp: 1, 2, 3, 3, ...), and the joined chunks are the audio of the
non-streaming path (code2wav's whole-request decode of the same codes). A bad value stops
the start before any stage process runs. The same options on Qwen3-Omni's code2wav: the
worker builds the stage with the bundled ones, and a 1-frame first chunk joins to
transformers' whole decode."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import in_threads
from tests.models.codec_streams import audio_of, open_empty, run_stream, snr_db
from tests.models.test_qwen3_tts import CASES, SEED, case_prompt
from vllm_omni import AsyncOmni, Omni
from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.model_executor.models.codec_streaming import ChunkRamp
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStreamConfig
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest
from vllm_omni.worker.gpu_generation_worker import GPUGenerationWorker

FRAMES = 20  # the talker's frames per request (min_tokens = max_tokens)
TALKER = {"temperature": 0.0, "max_tokens": FRAMES, "min_tokens": FRAMES, "repetition_penalty": 1.05}


def deploy_file(tmp_path, extra: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""\
base_config: qwen3_tts.yaml
connectors:
  connector_of_shared_memory:
    name: SharedMemoryConnector
    extra: {extra}
""")
    return str(path)


@pytest.fixture(scope="module")
def custom_voice(tiny_model):
    return tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")


async def collect(omni, prompt, params):
    return [out async for out in omni.generate(prompt, params, request_id="r", output_partial=True)]


def test_connector_chunk_options_shape_the_streamed_audio(custom_voice, tmp_path):
    deploy = deploy_file(tmp_path, "{initial_codec_chunk_frames: 1, codec_chunk_frames: 3}")
    omni = AsyncOmni(model=str(custom_voice), deploy_config=deploy, stage_overrides=in_threads(2))
    try:
        outs = asyncio.run(collect(omni, case_prompt("CustomVoice", CASES["CustomVoice"][0]), [TALKER, None]))
    finally:
        omni.close()
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    chunks = [o.delta.multimodal_output["audio"] for o in outs if o.delta.multimodal_output.get("audio") is not None]
    chunks = [c for c in chunks if c.numel()]

    model = Qwen3TTSCode2Wav.load(str(custom_voice))
    codes = outs[-1].request_output.prompt_token_ids  # the code2wav request: every frame, codebook-major
    [whole] = model.generate_batch([StageRequest(request_id="w", prompt_token_ids=codes,
                                                 sampling_params=SamplingParams())])
    spf = model.decoder.samples_per_frame
    assert len(codes) == FRAMES * model.decoder.num_quantizers and whole["audio"].numel() == FRAMES * spf

    ramp, expected, at = ChunkRamp(1, 3), [], 0
    while at < FRAMES:
        expected.append(min(ramp.size(len(expected)), FRAMES - at))
        at += expected[-1]
    assert expected[:5] == [1, 1, 2, 3, 3]
    assert [c.numel() / spf for c in chunks] == expected  # chunk sizes in frames
    torch.testing.assert_close(torch.cat(chunks), whole["audio"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("extra, match", [
    ("{codec_chunk_frames: 0}", r"stage 1: .*codec_chunk_frames=0"),
    ("{initial_codec_chunk_frames: 1, codec_left_context_frames: 0}", r"stage 1: .*left_context_frames must be >= 1"),
    ("{codec_chunk_ramp_divisor: 0}", r"stage 1: .*divisor must be >= 1"),
])
def test_bad_chunk_option_is_refused_at_startup(custom_voice, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        Omni(model=str(custom_voice), deploy_config=deploy_file(tmp_path, extra))


def test_qwen3_omni_code2wav_stage_is_built_with_the_bundled_chunks(tiny_model):
    """The generation worker hands the connector's options to the model's load()."""
    ckpt = str(tiny_model("qwen3_omni_moe"))
    pipeline = load_pipeline_config(model=ckpt)
    engine = GPUGenerationWorker(pipeline.stage(2), ckpt, device="cpu").build_engine()
    assert engine.model.stream_config == Code2WavStreamConfig(initial_chunk_frames=2, chunk_frames=25,
                                                              left_context_frames=25)


@pytest.mark.parametrize("options, frames_per_chunk", [
    # A 1-frame first chunk and 3-frame chunks.
    ({"initial_codec_chunk_frames": 1, "codec_chunk_frames": 3}, [1, 1, 2] + [3] * 18 + [2]),
    # The slower ramp (each chunk half of all before it) up to the bundled 25 frames.
    ({"initial_codec_chunk_frames": 2, "codec_chunk_frames": 25, "codec_chunk_ramp_divisor": 2},
     [2, 1, 2, 3, 4, 6, 9, 14, 19]),
])
@torch.inference_mode()
def test_qwen3_omni_chunk_options_join_to_the_whole_decode(tiny_model, options, frames_per_chunk):
    """Chunks set by connector options against transformers' whole decode: the first chunk is
    exact (the decoder is causal, it needs no context), the rest within the tolerance of the
    default chunks (tests/models/test_qwen3_omni_code2wav_streaming.py)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ckpt = tiny_model("qwen3_omni_moe")
    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).code2wav.eval()
    model = Qwen3OmniMoeCode2Wav.load(str(ckpt), stream_config=Code2WavStreamConfig.from_options(options))
    frames = torch.randint(0, model.codebook_size, (60, model.num_quantizers),
                           generator=torch.Generator().manual_seed(4))
    whole = reference(frames.T[None]).reshape(-1)
    chunks = audio_of(run_stream(model, open_empty(model), frames, pieces=[1] * 60))
    spf, tail = model.samples_per_frame, model.unfinished_samples
    assert [c.numel() for c in chunks] == [frames_per_chunk[0] * spf - tail] + [n * spf for n in frames_per_chunk[1:]]
    first = frames_per_chunk[0] * spf - tail
    torch.testing.assert_close(chunks[0], whole[:first], rtol=0, atol=1e-6)
    streamed = torch.cat(chunks)
    assert streamed.shape == whole.shape
    max_abs, snr = (streamed - whole).abs().max().item(), snr_db(whole, streamed)
    print(f"qwen3 code2wav {options} vs whole: max abs {max_abs:.2e}, SNR {snr:.1f} dB")
    assert max_abs <= 5e-3 and snr >= 50
