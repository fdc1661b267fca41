"""What the code2wav CUDA graphs rely on (decoder_graphs.py), checked on the CPU with the tiny
Qwen3-TTS decoder: padding a call's rows with code 0 and its frames on the right changes no
sample of the real rows and frames (beyond float32 rounding of other GEMM shapes). tests/gpu/test_decoder_graphs.py replays the graphs."""
from __future__ import annotations

import torch

from tests.models.codec_streams import open_empty
from vllm_omni.model_executor.models.decoder_graphs import (
    BUCKETS, DecoderGraphs, StreamGraphs, bucket, graph_buckets, streams_within_budget,
)
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStreamConfig
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket(BUCKETS[-1] + 1) is None


def test_graphs_cover_many_short_windows_and_few_long_ones():
    """A stage's longest window is 50 frames (25 of context + a 25-frame chunk): graphs for up to
    4 rows of any window, and for up to 64 rows of first chunks (a few frames each)."""
    keys = set(graph_buckets(max_frames=50))
    assert {(1, 64), (4, 64), (8, 32), (32, 8), (64, 4)} <= keys
    assert not keys & {(8, 64), (16, 32), (64, 8)}  # GPU-bound: run eagerly, unpadded
    assert max(f for _, f in graph_buckets(max_frames=11)) == 16


def test_padding_leaves_the_real_samples_unchanged(tiny_model):
    model = Qwen3TTSCode2Wav.load(str(tiny_model("qwen3_tts")), device="cpu")
    decoder, spf = model.decoder, model.decoder.samples_per_frame
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, decoder.codebook_size, (3, decoder.num_quantizers, 5), generator=gen)
    with torch.inference_mode():
        alone = [decoder(codes[i:i + 1]) for i in range(3)]
        padded = torch.zeros(4, decoder.num_quantizers, 8, dtype=torch.long)  # the (4, 8) bucket
        padded[:3, :, :5] = codes
        out = decoder(padded)
    for i in range(3):
        torch.testing.assert_close(out[i:i + 1, ..., :5 * spf], alone[i][..., :5 * spf], atol=1e-5, rtol=0)


def test_on_the_cpu_the_decoder_runs_eagerly(tiny_model):
    model = Qwen3TTSCode2Wav.load(str(tiny_model("qwen3_tts")), device="cpu", cuda_graphs=True)
    assert model.graphs is None  # graphs are CUDA-only
    calls = []
    graphs = DecoderGraphs(lambda codes: calls.append(codes.shape) or codes.float(), num_quantizers=2)
    graphs(torch.zeros(3, 2, 5, dtype=torch.long))
    assert calls == [(3, 2, 5)]  # CPU tensors: the decoder itself, unpadded


def test_steps_of_streamed_windows_fit_the_graphs(tiny_model):
    """StreamGraphs for the default chunks (25 + 25 frames, the vocoder reading 5 back): the
    steady window's graph starts the vocoder 20 frames in; first chunks have graphs of their
    own for every new stream at once; a step of later chunks takes the windows 4 steady graphs
    hold (`streams_within_budget`, what code2wav's `streams_per_step` says), at least one."""
    model = Qwen3TTSCode2Wav.load(str(tiny_model("qwen3_tts")), device="cpu")  # 4-frame first chunk, 25 + 25
    decoder = model.decoder
    graphs = StreamGraphs(decoder, decoder.num_quantizers, decoder.samples_per_frame, model.stream_config,
                          vocoder_context_frames=5)
    assert graphs.later.steady == (50, 20) and {(4, 50, 20), (1, 64, 0)} <= graphs.later.buckets
    assert graphs.first.steady is None and {(64, 4, 0), (64, 1, 0)} <= graphs.first.buckets
    assert graphs.step_frame_budget == 200
    streams = [open_empty(model, rid=str(i)) for i in range(8)]
    for i, stream in enumerate(streams):
        stream.push(torch.zeros(100, decoder.num_quantizers, dtype=torch.long), final=False)
        for _ in range(min(i, 5)):  # stream i is past its first i chunks (4, 4, 8, 16, 25 frames)
            stream.commit(stream.next_window())
    assert graphs.for_streams(streams[:1]) is graphs.first and graphs.for_streams(streams[:2]) is graphs.later
    sizes = [s.next_window_frames() for s in streams]
    assert sizes == [s.next_window().codes.shape[1] for s in streams] == [4, 8, 16, 32] + [50] * 4
    assert streams_within_budget(graphs, streams) == 6  # 160 frames, and 50 more would pass 200
    assert streams_within_budget(graphs, streams[4:]) == 4  # the budget: 4 steady windows
    assert streams_within_budget(None, streams) == 8  # no graphs: one call for all
    assert streams_within_budget(StreamGraphs(decoder, decoder.num_quantizers, decoder.samples_per_frame,
                                              model.stream_config, vocoder_context_frames=25), streams) == 8
    # No small first chunk (upstream's initial 0): first chunks are whole chunks, in first graphs too.
    whole_first = Code2WavStreamConfig(initial_chunk_frames=0, chunk_frames=25, left_context_frames=4)
    graphs = StreamGraphs(decoder, decoder.num_quantizers, decoder.samples_per_frame, whole_first, 5)
    assert (4, 32, 0) in graphs.first.buckets and graphs.later.steady is None  # 4 frames: nothing to skip
