"""What the code2wav CUDA graphs rely on (decoder_graphs.py), checked on the CPU with the tiny
Qwen3-TTS decoder: padding a call's rows with code 0 and its frames on the right changes no
sample of the real rows and frames (beyond float32 rounding of other GEMM shapes). tests/gpu/test_decoder_graphs.py replays the graphs."""
from __future__ import annotations

import torch

from vllm_omni.model_executor.models.decoder_graphs import BUCKETS, DecoderGraphs, bucket, graph_buckets
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
    assert model.decode_window is model.decoder  # graphs are CUDA-only
    calls = []
    graphs = DecoderGraphs(lambda codes: calls.append(codes.shape) or codes.float(), num_quantizers=2)
    graphs(torch.zeros(3, 2, 5, dtype=torch.long))
    assert calls == [(3, 2, 5)]  # CPU tensors: the decoder itself, unpadded
