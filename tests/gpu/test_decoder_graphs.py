"""Qwen3-TTS code2wav streams with the decoder's CUDA graphs against the eager decoder (tiny
checkpoint, float32): several streams in one batch (rows padded to a bucket), first chunks of one
frame and later chunks with left context (frames padded), every chunk's audio equal."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.codec_streams import open_empty  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.code2wav_stream import Code2WavStreamConfig  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav  # noqa: E402


def _chunks(model, frames: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    streams = [open_empty(model, rid=str(i)) for i in range(len(frames))]
    for stream, f in zip(streams, frames):
        stream.push(f, final=True)
    chunks: list[list[torch.Tensor]] = [[] for _ in frames]
    while any(s.ready() for s in streams):
        ready = [i for i, s in enumerate(streams) if s.ready()]
        for i, out in zip(ready, model.decode_streams([streams[i] for i in ready])):
            chunks[i].append(out["audio"])
    return chunks


def test_graphed_streams_equal_eager(tiny_model):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = str(tiny_model("qwen3_tts"))
    config = Code2WavStreamConfig(initial_chunk_frames=1, chunk_frames=6, left_context_frames=5)
    eager = Qwen3TTSCode2Wav.load(folder, device="cuda", stream_config=config)
    graphed = Qwen3TTSCode2Wav.load(folder, device="cuda", stream_config=config, cuda_graphs=True)
    assert graphed.decode_window is not graphed.decoder
    gen = torch.Generator().manual_seed(0)
    q, size = eager.decoder.num_quantizers, eager.decoder.codebook_size
    frames = [torch.randint(0, size, (n, q), generator=gen) for n in (17, 5, 30)]
    for _ in range(2):  # the second pass replays graphs captured in the first
        expected, got = _chunks(eager, frames), _chunks(graphed, frames)
        for e, g in zip(expected, got):
            assert len(e) == len(g) > 1
            for a, b in zip(e, g):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
