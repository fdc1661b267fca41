"""Code2wav streams with the decoders' CUDA graphs against the eager decoders (Qwen3-TTS and
Qwen3-Omni tiny checkpoints, float32): several streams in one batch (rows padded to a bucket),
first chunks of one frame and later chunks with left context (frames padded), every chunk's
audio equal."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.codec_streams import open_empty  # noqa: E402
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStreamConfig  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav  # noqa: E402

FAMILIES = {"qwen3_tts": Qwen3TTSCode2Wav, "qwen3_omni_moe": Qwen3OmniMoeCode2Wav}


def _chunks(model, frames: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every stream's chunks, decoded in steps as the engine plans them (`streams_per_step`)."""
    streams = [open_empty(model, rid=str(i)) for i in range(len(frames))]
    for stream, f in zip(streams, frames):
        stream.push(f, final=True)
    chunks: list[list[torch.Tensor]] = [[] for _ in frames]
    plan = model.streams_per_step  # (GenerationModel: every stream by default)
    while any(s.ready() for s in streams):
        ready = [i for i, s in enumerate(streams) if s.ready()]
        ready = ready[: plan([streams[i] for i in ready])]
        for i, out in zip(ready, model.decode_streams([streams[i] for i in ready])):
            chunks[i].append(out["audio"])
    return chunks


@pytest.mark.parametrize("lengths", [(17, 5, 30), tuple(range(3, 15))], ids=["3-streams", "12-streams"])
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_streams_equal_eager(tiny_model, family, lengths):
    """12 streams: their first chunks (and second) replay the graphs of many rows of short
    windows; their longer windows, too many frame-rows for a graph, run eagerly."""
    folder, cls = str(tiny_model(family)), FAMILIES[family]
    config = Code2WavStreamConfig(initial_chunk_frames=1, chunk_frames=6, left_context_frames=5)
    eager = cls.load(folder, device="cuda", dtype="float32", stream_config=config)  # "auto": TF32
    graphed = cls.load(folder, device="cuda", dtype="float32", stream_config=config, cuda_graphs=True)
    gen = torch.Generator().manual_seed(0)
    codec = getattr(eager, "decoder", eager)  # Qwen3-TTS keeps the codebook sizes on its decoder
    frames = [torch.randint(0, codec.codebook_size, (n, codec.num_quantizers), generator=gen) for n in lengths]
    for _ in range(2):  # the second pass replays the same graphs again
        expected, got = _chunks(eager, frames), _chunks(graphed, frames)
        for e, g in zip(expected, got):
            assert len(e) == len(g) > 1
            for a, b in zip(e, g):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_steady_chunks_replay_trimmed_graphs(tiny_model):
    """Qwen3-TTS with 8 frames of context (3 more than its vocoder reads): 6 streams' steady
    chunks go in steps of what the graphs hold, each replaying the graph of the steady window
    with the vocoder trimmed, and no call runs eagerly; audio as the eager decoder's."""
    folder = str(tiny_model("qwen3_tts"))
    config = Code2WavStreamConfig(initial_chunk_frames=1, chunk_frames=6, left_context_frames=8)
    eager = Qwen3TTSCode2Wav.load(folder, device="cuda", dtype="float32", stream_config=config)
    graphed = Qwen3TTSCode2Wav.load(folder, device="cuda", dtype="float32", stream_config=config, cuda_graphs=True)
    assert graphed.graphs.later.steady == (14, 3)
    eager_calls = []
    for graphs in (graphed.graphs.later, graphed.graphs.first):
        graphs.decoder = lambda *args, run=graphs.decoder: eager_calls.append(args[0].shape) or run(*args)
    gen = torch.Generator().manual_seed(1)
    frames = [torch.randint(0, 64, (n, eager.decoder.num_quantizers), generator=gen) for n in (40, 37, 45, 40, 31, 50)]
    expected, got = _chunks(eager, frames), _chunks(graphed, frames)
    assert eager_calls == []
    for e, g in zip(expected, got):
        assert len(e) == len(g) > 4
        for a, b in zip(e, g):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
