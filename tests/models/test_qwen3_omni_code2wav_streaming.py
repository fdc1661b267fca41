"""Qwen3-Omni code2wav streaming and batching, on tiny random checkpoints.

The reference is transformers' own `Qwen3OmniMoeCode2Wav` from the checkpoint: its
`chunked_decode` for chunked audio, its forward for whole requests. A streamed request is
compared with it bit for bit where the math is the same, and by max abs / SNR where the
left context cuts what the decoder would see. A stream's vocoder starts
`vocoder_context_frames` before each chunk: its audio is the whole windows' (checked against
streams that run the vocoder over whole windows), and a frame less would change it.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.codec_streams import audio_of, join_and_inner_jumps, open_empty, run_stream, snr_db
from vllm_omni.model_executor.models.code2wav_stream import Code2WavStreamConfig
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest

Q, CODEBOOK = 4, 64  # the tiny checkpoint's quantizers and codebook


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return tiny_model("qwen3_omni_moe")


@pytest.fixture(scope="module")
def hf_code2wav(ckpt):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).code2wav.eval()


def load(ckpt, **config) -> Qwen3OmniMoeCode2Wav:
    return Qwen3OmniMoeCode2Wav.load(str(ckpt), stream_config=Code2WavStreamConfig(**config))


def random_frames(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODEBOOK, (n, Q), generator=torch.Generator().manual_seed(seed))


def whole_request(frames: torch.Tensor, rid: str = "w") -> StageRequest:
    return StageRequest(request_id=rid, prompt_token_ids=frames.T.reshape(-1).tolist(), sampling_params=SamplingParams())


@torch.inference_mode()
def test_stream_is_transformers_chunked_decode_plus_the_samples_it_drops(ckpt, hf_code2wav):
    """With equal chunks the windows are chunked_decode's windows, bit for bit. chunked_decode
    loses the `tail` samples at the end of every chunk (its transposed convolutions wait for
    the next frame); the stream decodes them again at the start of the next chunk."""
    model = load(ckpt, initial_chunk_frames=20, chunk_frames=20, left_context_frames=25)
    frames = random_frames(137, seed=1)
    chunks = audio_of(run_stream(model, open_empty(model), frames, pieces=[3, 1, 40, 50, 43]))
    spf, tail = model.samples_per_frame, model.unfinished_samples
    assert [c.numel() for c in chunks] == [20 * spf - tail] + [20 * spf] * 5 + [17 * spf]
    ref = hf_code2wav.chunked_decode(frames.T[None], chunk_size=20, left_context_size=25).reshape(-1)
    assert ref.numel() == 137 * spf - 7 * tail
    assert torch.equal(torch.cat([chunks[0]] + [c[tail:] for c in chunks[1:]]), ref)
    whole = hf_code2wav(frames.T[None]).reshape(-1)
    assert torch.cat(chunks).numel() == whole.numel() == 137 * spf - tail  # nothing lost


@torch.inference_mode()
def test_stream_matches_whole_request(ckpt, hf_code2wav):
    """Default chunking (4, 4, 8, 16, 25, 25, ... frames; 25 frames of context) against the
    whole request decoded at once by transformers. Tolerance: SNR >= 50 dB and max abs
    <= 5e-3 (measured: 72 dB, 5e-4): 25 frames of context cut the decoder's reach (sliding
    attention and the convolutions reach ~40 frames back in the tiny model). With 60 frames
    of context the cut is gone and only float rounding (RoPE at shifted positions) is left."""
    frames = random_frames(137, seed=2)
    whole = hf_code2wav(frames.T[None]).reshape(-1)
    model = load(ckpt)
    outputs = run_stream(model, open_empty(model), frames, pieces=[1] * 137)  # frame by frame, like a talker
    streamed = torch.cat(audio_of(outputs))
    spf, tail = model.samples_per_frame, model.unfinished_samples
    assert [c.numel() for c in audio_of(outputs)] == [4 * spf - tail] + [n * spf for n in (4, 8, 16, 25, 25, 25, 25, 5)]
    assert outputs[0]["sample_rate"].item() == 24000 and all("sample_rate" not in o for o in outputs[1:])
    assert streamed.dtype == torch.float32 and streamed.shape == whole.shape
    max_abs, snr = (streamed - whole).abs().max().item(), snr_db(whole, streamed)
    print(f"qwen3 code2wav stream vs whole: max abs {max_abs:.2e}, SNR {snr:.1f} dB")
    assert max_abs <= 5e-3 and snr >= 50
    # The same codes pushed all at once: the same chunks, the same samples.
    assert torch.equal(torch.cat(audio_of(run_stream(model, open_empty(model), frames))), streamed)
    # The first frames need no context (the decoder is causal): the first chunk is exact.
    torch.testing.assert_close(audio_of(outputs)[0], whole[: 4 * spf - tail], atol=1e-6, rtol=0)

    wide = load(ckpt, left_context_frames=60)
    torch.testing.assert_close(torch.cat(audio_of(run_stream(wide, open_empty(wide), frames))), whole,
                               atol=1e-5, rtol=0)


def make_smooth(code2wav: torch.nn.Module) -> None:
    """Turn the tiny decoder into one whose waveform is smooth at the sample level, so that a
    click (a jump at a chunk join) stands out against the jumps inside chunks: residual units
    become identities, transposed convolutions linear interpolators, the ConvNeXt upsampler a
    repeater and the output convolution a moving average."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavDecoderBlock, Qwen3OmniMoeCode2WavDecoderResidualUnit,
    )

    with torch.no_grad():
        for module in code2wav.modules():
            if isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
                module.conv2.conv.weight.zero_()
                module.conv2.conv.bias.zero_()
            if isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
                conv = module.block[1].conv  # kernel 2 * rate, stride rate
                rate = conv.stride[0]
                ramp = torch.cat([torch.arange(1, rate + 1), torch.arange(rate - 1, -1, -1)]).float() / rate
                conv.weight.zero_()
                for out in range(conv.weight.shape[1]):
                    conv.weight[out % conv.weight.shape[0], out] = ramp
                conv.bias.zero_()
        repeat = code2wav.upsample[0][0].conv
        repeat.weight[:, :, 1:] = repeat.weight[:, :, :1]
        last = code2wav.decoder[-1].conv
        last.weight.copy_(last.weight.mean(-1, keepdim=True).expand_as(last.weight) * 0.5)


@torch.inference_mode()
def test_no_clicks_at_chunk_joins(tiny_model):
    """On a smooth signal (32 samples per frame), no jump across a chunk join is larger than
    the largest jump inside a chunk. transformers' chunked_decode, which drops samples at its
    joins, fails the same check: the check sees clicks."""
    model = load(tiny_model("qwen3_omni_moe", code2wav_upsample_rates=[4, 4]))
    make_smooth(model.module)
    frames = random_frames(137, seed=3)
    at_joins, inside = join_and_inner_jumps(audio_of(run_stream(model, open_empty(model), frames)))
    print(f"qwen3 largest jump: at joins {at_joins:.4f}, inside chunks {inside:.4f}")
    assert at_joins <= inside

    dropped = model.module.chunked_decode(frames.T[None], chunk_size=25, left_context_size=25).reshape(-1)
    chunk = 25 * model.samples_per_frame - model.unfinished_samples
    assert join_and_inner_jumps(list(dropped.split(chunk)))[0] > 2 * inside


@torch.inference_mode()
def test_audio_does_not_depend_on_batch_mates(ckpt):
    """Whole requests of mixed lengths in one generate_batch, and streams at different points
    of their requests in one decode_streams, against each alone. Not bit-identical on CPU:
    the convolution kernels block their sums by batch shape (measured <= 1e-6, also for two
    equal rows); the padding itself cannot reach a request (causal decoder), which the
    tolerance 1e-5 would show (a leak is of the signal's order, ~0.1)."""
    model = load(ckpt)
    lengths = {"a": 7, "b": 20, "c": 310, "d": 45, "e": 1}
    frames = {rid: random_frames(n, seed=10 + n) for rid, n in lengths.items()}
    batch = model.generate_batch([whole_request(f, rid) for rid, f in frames.items()])
    for (rid, f), out in zip(frames.items(), batch):
        [alone] = model.generate_batch([whole_request(f, rid)])
        assert out["audio"].shape == alone["audio"].shape
        torch.testing.assert_close(out["audio"], alone["audio"], atol=1e-5, rtol=0)

    got = decode_together(model, frames)
    for rid, f in frames.items():
        alone = torch.cat(audio_of(run_stream(model, open_empty(model), f)))
        torch.testing.assert_close(got[rid], alone, atol=1e-5, rtol=0)


def decode_together(model: Qwen3OmniMoeCode2Wav, frames: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each request's streamed audio, all streams decoded in the same calls (first chunks beside
    later ones: windows with different left contexts share a call)."""
    together = {rid: open_empty(model, rid) for rid in frames}
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in frames}
    for rid, stream in together.items():
        stream.push(frames[rid], final=True)
    while ready := [rid for rid, s in together.items() if s.ready()]:
        for rid, out in zip(ready, model.decode_streams([together[rid] for rid in ready])):
            got[rid].append(out["audio"])
    return {rid: torch.cat(chunks) for rid, chunks in got.items()}


# Vocoder layouts (upsample_rates after upsampling_ratios) and their vocoder_context_frames, which
# a brute-force Jacobian of the vocoder confirmed: the tiny checkpoint's, another, and the released
# one (5 frames: 20 vocoder input samples for the 555 unfinished samples before a chunk).
LAYOUTS = {
    "tiny": ({}, 34),
    "4x3-after-2x2": ({"code2wav_upsample_rates": [4, 3], "code2wav_upsampling_ratios": [2, 2]}, 9),
    "released": ({"code2wav_upsample_rates": [8, 5, 4, 3], "code2wav_upsampling_ratios": [2, 2]}, 5),
}


def carry_signal(model: Qwen3OmniMoeCode2Wav) -> None:
    """Vocoder weights that carry the signal through every layer: the far end of its receptive
    field is a product of edge taps, ~1e-11 of the output in the tiny checkpoint's small weights."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.module.decoder.parameters():
            if p.dim() > 1:  # convolution weights: N(0, 0.1)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # biases, SnakeBeta's alpha and beta: U(-0.3, 0.3)
                p.copy_(torch.rand(p.shape, generator=gen) * 0.6 - 0.3)


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_streamed_vocoder_skips_only_context_it_does_not_read(tiny_model, layout):
    """Streams whose vocoder starts `vocoder_context_frames` before each chunk (per call: where
    every row has that much context) against streams that vocode whole windows: equal within
    1e-5 (convolutions over other lengths round differently, measured <= 5e-7; a frame of vocoder
    context less moves two of these layouts by 2e-4). 40 frames of left context, more than the
    tiny layout's 34: every layout skips some."""
    overrides, reach = LAYOUTS[layout]
    model = load(tiny_model("qwen3_omni_moe", **overrides), left_context_frames=40)
    assert model.vocoder_context_frames == reach
    carry_signal(model)
    frames = {rid: random_frames(n, seed=20 + n) for rid, n in {"a": 137, "b": 60, "c": 9}.items()}
    trimmed = decode_together(model, frames)
    model.vocoder_context_frames = 10**6  # no skip: the whole windows
    for rid, f in frames.items():
        whole_windows = torch.cat(audio_of(run_stream(model, open_empty(model), f)))
        torch.testing.assert_close(trimmed[rid], whole_windows, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_one_frame_less_of_vocoder_context_changes_the_audio(tiny_model, layout):
    """`vocoder_context_frames` is tight: with it a chunk's samples are the whole window's, with a
    frame less they are not. In float64 (rounding ~1e-16: trimmed == whole exactly here), so that
    the far end of the receptive field shows in every layout (a frame less: 3e-6 to 2e-4)."""
    overrides, reach = LAYOUTS[layout]
    model = load(tiny_model("qwen3_omni_moe", **overrides))
    carry_signal(model)
    model.module.double()
    spf, unfinished, context = model.samples_per_frame, model.unfinished_samples, reach + 6
    codes = torch.randint(0, CODEBOOK, (2, Q, context + 10), generator=torch.Generator().manual_seed(1))
    # A chunk after `context` frames: its new samples start `unfinished` before its first frame.
    whole = model._decode_from(codes)[:, 0, context * spf - unfinished:]
    trimmed = model._decode_from(codes, context - reach)[:, 0, reach * spf - unfinished:]
    short = model._decode_from(codes, context - reach + 1)[:, 0, (reach - 1) * spf - unfinished:]
    assert trimmed.shape == short.shape == whole.shape
    torch.testing.assert_close(trimmed, whole, atol=1e-12, rtol=0)
    assert (short - whole).abs().max() > 1e-7


@torch.inference_mode()
def test_steady_chunks_vocode_only_their_receptive_field(tiny_model):
    """With the default chunks (4, 4, 8, 16, then 25 frames with 25 of context) the vocoder (a hook
    on its first layer) sees a chunk's frames plus `vocoder_context_frames` once the context is
    longer than that: a steady chunk is 25 + 9 frames of vocoder work, not 50."""
    overrides, reach = LAYOUTS["4x3-after-2x2"]
    model = load(tiny_model("qwen3_omni_moe", **overrides))
    per_frame = model.vocoder_input_per_frame
    seen: list[int] = []
    model.module.decoder[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-1] // per_frame))
    run_stream(model, open_empty(model), random_frames(137, seed=4))
    assert seen == [4, 4 + 4, 8 + 8, 16 + reach] + [25 + reach] * 4 + [5 + reach]


def test_stream_errors(ckpt):
    model = load(ckpt)
    stream = open_empty(model)
    with pytest.raises(ValueError, match=r"integer codec frames \[n, 4\]"):
        stream.push(torch.zeros(3, 5, dtype=torch.long), final=False)
    with pytest.raises(ValueError, match="must lie in"):
        stream.push(torch.full((1, Q), CODEBOOK), final=False)
    stream.push(random_frames(2, seed=0), final=True)
    with pytest.raises(ValueError, match="after the final push"):
        stream.push(random_frames(1, seed=0), final=False)
    empty = open_empty(model)
    empty.push(torch.zeros(0, Q, dtype=torch.long), final=True)
    assert empty.finished and not empty.ready()
    waiting = open_empty(model)
    waiting.push(random_frames(3, seed=0), final=False)  # the first chunk needs 4 frames
    assert not waiting.ready() and waiting.consumed == 0
    with pytest.raises(RuntimeError, match="no chunk is ready"):
        model.decode_streams([waiting])
    # The request's own codes (codebook-major, like a whole request) are its first frames.
    first = model.open_stream(whole_request(random_frames(4, seed=0)))
    assert first.ready()
    with pytest.raises(ValueError, match="left_context_frames"):
        Code2WavStreamConfig(left_context_frames=0)
    with pytest.raises(ValueError, match="initial"):
        Code2WavStreamConfig(initial_chunk_frames=30, chunk_frames=25)
    assert Code2WavStreamConfig.from_options({"codec_chunk_frames": 50, "initial_codec_chunk_frames": 2}) \
        == Code2WavStreamConfig(2, 50, 25)
    # Upstream's initial_codec_chunk_frames 0: no small first chunk.
    assert Code2WavStreamConfig.from_options({"initial_codec_chunk_frames": 0}).ramp.size(0) == 25
    for bad, match in [({"other": 1}, "does not read other"), ({"codec_chunk_frames": 0}, "codec_chunk_frames=0"),
                       ({"codec_left_context_frames": -1}, "left_context_frames must be >= 1"),
                       ({"codec_chunk_frames": "25"}, "must be an integer"), ({"codec_chunk_frames": True}, "integer")]:
        with pytest.raises(ValueError, match=match):
            Code2WavStreamConfig.from_options(bad)


def test_vocoder_runs_our_layers_with_the_checkpoint_weights(ckpt, hf_code2wav):
    """transformers' vocoder layers are replaced by ours (layers/vocoder.py) with the same
    parameters; the exactness tests above compare the result with transformers' own module."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    from vllm_omni.model_executor.layers.activation import SnakeBeta

    module = load(ckpt).module
    replaced = (hf.Qwen3OmniMoeSnakeBeta, hf.Qwen3OmniMoeCausalConvNet, hf.Qwen3OmniMoeCausalTransConvNet,
                hf.Qwen3OmniMoeCode2WavDecoderResidualUnit)
    assert not any(isinstance(m, replaced) for m in module.modules())
    assert sum(isinstance(m, SnakeBeta) for m in module.modules()) == sum(
        isinstance(m, hf.Qwen3OmniMoeSnakeBeta) for m in hf_code2wav.modules()) > 0
    theirs = hf_code2wav.state_dict()
    assert module.state_dict().keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in module.state_dict().items())
    assert not any(m.training for m in module.modules())
