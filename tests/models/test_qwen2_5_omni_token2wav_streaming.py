"""Qwen2.5-Omni token2wav streaming and batching, on the tiny random checkpoint.

The reference is transformers' `Qwen2_5OmniToken2WavModel` from the checkpoint, run with
`torch.manual_seed(seed)` before it draws its noise, and our whole-request path (which
tests/models/test_qwen2_5_omni_talker.py holds to transformers).
"""
from __future__ import annotations

import pytest
import torch

from tests.models.codec_streams import audio_of, join_and_inner_jumps, open_empty, run_stream, snr_db
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_stream import Token2WavStreamConfig
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_vocoder import receptive_field
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest

STEPS = 4  # ODE steps: fewer than the default 10, the same code paths
CODES = 124  # the tiny talker's codebook (codec specials above it)


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return tiny_model("qwen2_5_omni")


@pytest.fixture(scope="module")
def hf_token2wav(ckpt):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model.token2wav, model.speaker_map


def load(ckpt, **config) -> Qwen2_5OmniToken2Wav:
    return Qwen2_5OmniToken2Wav.load(str(ckpt), stream_config=Token2WavStreamConfig(**config))


def random_codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODES, (n,), generator=torch.Generator().manual_seed(seed))


def whole_request(codes: torch.Tensor, seed: int, rid: str = "w", **info) -> StageRequest:
    return StageRequest(request_id=rid, prompt_token_ids=codes.tolist(), sampling_params=SamplingParams(seed=seed),
                        additional_information={"num_steps": STEPS, **info})


def stream_audio(model, codes: torch.Tensor, seed: int, pieces=None) -> list[torch.Tensor]:
    return audio_of(run_stream(model, open_empty(model, seed=seed, num_steps=STEPS), codes, pieces))


@torch.inference_mode()
def test_short_stream_is_the_whole_request_and_transformers(ckpt, hf_token2wav):
    """A request that ends inside its first window is decoded as one window: the whole
    request's computation exactly, noise included (the request's seed, drawn in blocks)."""
    model = load(ckpt)
    codes = random_codes(30, seed=1)  # 60 mel frames < first chunk (72) + look-ahead (24)
    [whole] = model.generate_batch([whole_request(codes, seed=7)])
    chunks = stream_audio(model, codes, seed=7, pieces=[5, 5, 20])
    assert len(chunks) == 1 and torch.equal(chunks[0], whole["audio"])
    hf, speakers = hf_token2wav
    torch.manual_seed(7)
    ref = hf(codes[None], conditioning=speakers["Chelsie"]["cond"].float(),
             reference_mel=speakers["Chelsie"]["ref_mel"].float(), num_steps=STEPS).reshape(-1)
    torch.testing.assert_close(chunks[0], ref, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_stream_matches_whole_request(ckpt):
    """Default chunking (3 blocks, 3 again, then 6; 1 block of look-back and 1 of look-ahead for the tiny
    DiT's one look-back and one look-ahead layer; the vocoder's 15-frame receptive field held
    back). The ODE couples all positions, so windows differ from the whole request:
    tolerance SNR >= 70 dB and max abs <= 1e-4 (measured: 99.9 dB, 1.5e-6 on a 0.07 signal).
    The bound sees what the context buys: without look-back / look-ahead blocks SNR is 56 dB,
    without vocoder overlap 15 dB."""
    model = load(ckpt)
    codes, seed = random_codes(150, seed=2), 11
    [whole] = model.generate_batch([whole_request(codes, seed)])
    whole = whole["audio"]
    chunks = stream_audio(model, codes, seed, pieces=[1] * 150)  # code by code, like a talker
    hop, held = 20, 15  # tiny vocoder: 20 samples per mel frame, 15 frames held back
    assert [c.numel() for c in chunks] == [(72 - held) * hop, 72 * hop, (300 - 144 + held) * hop]
    streamed = torch.cat(chunks)
    assert streamed.shape == whole.shape
    max_abs, snr = (streamed - whole).abs().max().item(), snr_db(whole, streamed)
    print(f"qwen2.5 token2wav stream vs whole: max abs {max_abs:.2e}, SNR {snr:.1f} dB")
    assert max_abs <= 1e-4 and snr >= 70
    assert torch.equal(torch.cat(stream_audio(model, codes, seed)), streamed)  # however the codes arrive

    for blind in (load(ckpt, past_blocks=0, future_blocks=0), load(ckpt, vocoder_context_frames=0)):
        assert snr_db(whole, torch.cat(stream_audio(blind, codes, seed))) < 70


def test_vocoder_receptive_field(ckpt):
    """The samples of a mel frame depend on no frame further than the receptive field (so
    overlap-save with that much context is exact), and the field is not loose: changes reach
    past half of it in float32 (the Kaiser filters' far taps fall below float32 rounding).
    The released configuration's 34 frames were also measured by autograd (float64 copy)."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    vocoder = load(ckpt).bigvgan
    field, hop, frames, probe = receptive_field(vocoder), 20, 80, 40
    assert field == 15
    mel = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(0))
    bumped = mel.clone()
    bumped[..., probe] += 1.0
    with torch.no_grad():
        changed = ((vocoder(mel) - vocoder(bumped)).reshape(frames, hop).abs().amax(1) > 0).nonzero().flatten()
    assert probe - field <= changed.min() < probe - field // 2 and probe + field // 2 < changed.max() <= probe + field
    with torch.device("meta"):
        assert receptive_field(Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig())) == 34


def make_smooth(bigvgan: torch.nn.Module) -> None:
    """Turn the tiny vocoder into one whose waveform is smooth at the sample level, so that a
    click stands out: its upsampling convolutions become linear interpolators, its residual
    blocks identities and its output convolution a moving average."""
    with torch.no_grad():
        for (up,) in bigvgan.ups:
            stride, kernel = up.stride[0], up.kernel_size[0]
            taps = (1 - (torch.arange(kernel) - (kernel - 1) / 2).abs() / stride).clamp(min=0)
            up.weight.zero_()
            up.bias.zero_()
            for channel in range(up.weight.shape[1]):
                up.weight[channel, channel] = taps
        for block in bigvgan.resblocks:
            for conv in [*block.convs1, *block.convs2]:
                conv.weight.zero_()
                conv.bias.zero_()
        post = bigvgan.conv_post
        post.weight.copy_(post.weight.mean(-1, keepdim=True).expand_as(post.weight))


@torch.inference_mode()
def test_no_clicks_at_chunk_joins(ckpt):
    """On a smooth signal, no jump across a chunk join is larger than the largest jump
    inside a chunk. Vocoding each chunk on its own (no overlap) fails the same check."""
    model = load(ckpt)
    make_smooth(model.bigvgan)
    codes = random_codes(150, seed=3)
    at_joins, inside = join_and_inner_jumps(stream_audio(model, codes, seed=5))
    print(f"qwen2.5 largest jump: at joins {at_joins:.4f}, inside chunks {inside:.4f}")
    assert at_joins <= inside

    no_overlap = load(ckpt, vocoder_context_frames=0)
    make_smooth(no_overlap.bigvgan)
    assert join_and_inner_jumps(stream_audio(no_overlap, codes, seed=5))[0] > 2 * inside


@torch.inference_mode()
def test_audio_does_not_depend_on_batch_mates(ckpt):
    """Requests of different lengths, voices, seeds and step counts in one generate_batch,
    and streams at different points in one decode_streams, against each alone. The DiT pads
    rows and masks the padding out of the block attention; not bit-identical on CPU (kernels
    block sums by shape: measured <= 5e-8), tolerance 1e-6 (without the mask: 6e-4)."""
    model = load(ckpt)
    specs = {"a": (13, 1, "Chelsie", 3), "b": (37, 2, "Ethan", 3), "c": (20, 3, "Chelsie", 4),
             "d": (50, 4, "Ethan", 3), "e": (1, 5, None, 3)}
    requests = [StageRequest(request_id=rid, prompt_token_ids=random_codes(n, seed).tolist(),
                             sampling_params=SamplingParams(seed=seed),
                             additional_information={"num_steps": steps, **({"speaker": spk} if spk else {})})
                for rid, (n, seed, spk, steps) in specs.items()]
    for req, out in zip(requests, model.generate_batch(requests)):
        [alone] = model.generate_batch([req])
        assert out["audio"].shape == alone["audio"].shape == (len(req.prompt_token_ids) * 2 * 20,)
        torch.testing.assert_close(out["audio"], alone["audio"], atol=1e-6, rtol=0)

    def opened(req):
        stream = model.open_stream(StageRequest(request_id=req.request_id, prompt_token_ids=[],
                                                sampling_params=req.sampling_params,
                                                additional_information=req.additional_information))
        stream.push(torch.tensor(req.prompt_token_ids), final=True)
        return stream

    streams = {req.request_id: opened(req) for req in requests}
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in streams}
    while ready := [rid for rid, s in streams.items() if s.ready()]:
        for rid, out in zip(ready, model.decode_streams([streams[rid] for rid in ready])):
            got[rid].append(out["audio"])
    for req in requests:
        alone = opened(req)
        solo = []
        while alone.ready():
            solo.extend(audio_of(model.decode_streams([alone])))
        torch.testing.assert_close(torch.cat(got[req.request_id]), torch.cat(solo), atol=1e-6, rtol=0)


def test_stream_errors(ckpt):
    model = load(ckpt)
    stream = open_empty(model, seed=1)
    with pytest.raises(ValueError, match=r"integer codec codes \[n\]"):
        stream.push(torch.zeros(2, 2, dtype=torch.long), final=False)
    with pytest.raises(ValueError, match="must lie in"):
        stream.push(torch.tensor([500]), final=False)
    stream.push(random_codes(10, seed=0), final=False)
    assert not stream.ready() and stream.consumed == 0  # 3 blocks + 1 block of look-ahead + 1 code
    with pytest.raises(RuntimeError, match="no chunk is ready"):
        model.decode_streams([stream])
    stream.push(random_codes(2, seed=0), final=True)
    with pytest.raises(ValueError, match="after the final push"):
        stream.push(random_codes(1, seed=0), final=False)
    assert stream.ready()
    model.decode_streams([stream])
    assert stream.finished and stream.consumed == 12
    with pytest.raises(ValueError, match="unknown speaker"):
        open_empty(model, speaker="Nobody")
    with pytest.raises(ValueError, match="initial"):
        Token2WavStreamConfig(initial_chunk_blocks=4, chunk_blocks=3)
    assert Token2WavStreamConfig.from_options({"chunk_blocks": 4}) == Token2WavStreamConfig(chunk_blocks=4)
    with pytest.raises(ValueError, match="does not read codec_chunk_frames"):  # 12.5 Hz frames: not this decoder's
        Token2WavStreamConfig.from_options({"codec_chunk_frames": 25})


@torch.inference_mode()
def test_a_failed_call_leaves_its_streams_as_they_were(ckpt, monkeypatch):
    """The engine retries the streams of a failed `decode_streams` call one by one
    (generation_stage_engine `_isolate`), so the call must not have moved them on: after a
    vocoder failure (injected, after the DiT ran), each stream retried alone gives exactly the
    audio of an undisturbed run (before, a one-window stream had nothing left to decode)."""
    from vllm_omni.model_executor.models.qwen2_5_omni import token2wav

    model = load(ckpt)
    codes = {"a": random_codes(40, seed=1), "b": random_codes(150, seed=2)}
    undisturbed = {rid: torch.cat(stream_audio(model, c, seed=3)) for rid, c in codes.items()}
    streams = {rid: open_empty(model, rid, seed=3, num_steps=STEPS) for rid in codes}
    for rid, stream in streams.items():
        stream.push(codes[rid], final=True)
    vocode_windows = token2wav.vocode_windows

    def fail_once(*args):
        monkeypatch.setattr(token2wav, "vocode_windows", vocode_windows)
        raise RuntimeError("injected vocoder failure")

    monkeypatch.setattr(token2wav, "vocode_windows", fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        model.decode_streams(list(streams.values()))
    for rid, stream in streams.items():
        retried = []
        while stream.ready():
            retried.extend(audio_of(model.decode_streams([stream])))
        assert retried and torch.equal(torch.cat(retried), undisturbed[rid]), rid
