"""Qwen2.5-Omni token2wav on tiny configurations unlike the default one, whole and streamed,
alone and batched, against transformers' `Qwen2_5OmniToken2WavModel` (the reference and the
tolerances of test_qwen2_5_omni_token2wav_streaming.py).

- BigVGAN upsample layers whose kernel - stride is odd: transformers pads them by
  (kernel - stride) // 2, so each gives one sample more than its stride per frame, and a
  request's waveform runs `tail_samples` past frames * hop; the stream's last chunk carries them.
- mel sizes whose rows are not whole groups of 16 random values (torch's CPU randn), so the
  noise of a request's last values depends on its length; and a mel so small that a code's
  noise is under 16 values (a chunk waits for more than one code past its look-ahead).
- other DiT shapes: blocks, repeats, look-ahead / look-back layers, heads.
"""
from __future__ import annotations

import pytest
import torch

from tests.models.codec_streams import audio_of, open_empty, run_stream, snr_db
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_noise import new_generator, settle_codes, whole_noise
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_stream import (
    StreamGeometry, Token2WavStream, Token2WavStreamConfig,
)
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_vocoder import hop_length, tail_samples
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest

STEPS = 4
CODES = 124  # the tiny talker's codebook

CONFIGS = {  # overrides of the tiny checkpoint, and the vocoder's tail_samples
    "odd-kernel-4x3": (dict(bigvgan_upsample_rates=[4, 3], bigvgan_upsample_kernel_sizes=[8, 6]), 1),
    "odd-kernels-3x3x2": (dict(bigvgan_upsample_rates=[3, 3, 2], bigvgan_upsample_kernel_sizes=[6, 4, 3]), 9),
    "odd-kernel-5x2-mel20": (dict(bigvgan_upsample_rates=[5, 2], bigvgan_upsample_kernel_sizes=[10, 4],
                                  dit_mel_dim=20, bigvgan_mel_dim=20, dit_block_size=10), 2),
    "kernel-is-rate-mel6-repeats1": (dict(bigvgan_upsample_rates=[4, 3], bigvgan_upsample_kernel_sizes=[4, 3],
                                          dit_mel_dim=6, bigvgan_mel_dim=6, dit_repeats=1, dit_block_size=5), 0),
    "deep-dit": (dict(dit_num_hidden_layers=4, dit_look_ahead_layers=[0, 2], dit_look_backward_layers=[1, 3],
                      dit_num_attention_heads=4, dit_head_dim=8, dit_block_size=16), 0),
}
# codes, seed: 13 codes end in one window; 61 take two or more in every configuration.
REQUESTS = {"short": (13, 1), "long": (61, 3)}


def codes_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODES, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def transformers_audio(ckpt, codes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    voice = model.speaker_map["Chelsie"]
    out = {}
    for rid, c in codes.items():
        torch.manual_seed(REQUESTS[rid][1])  # our code2wav draws its noise from the request seed
        out[rid] = model.token2wav(c[None], conditioning=voice["cond"].float(), reference_mel=voice["ref_mel"].float(),
                                   num_steps=STEPS).reshape(-1)
    return out


@pytest.mark.parametrize("name", CONFIGS)
@torch.inference_mode()
def test_whole_and_streamed_requests_match_transformers(tiny_model, name):
    overrides, tail = CONFIGS[name]
    ckpt = tiny_model("qwen2_5_omni", **overrides)
    model = Qwen2_5OmniToken2Wav.load(str(ckpt))
    assert tail_samples(model.bigvgan) == tail
    codes = {rid: codes_of(n, seed) for rid, (n, seed) in REQUESTS.items()}
    requests = [StageRequest(request_id=rid, prompt_token_ids=c.tolist(), sampling_params=SamplingParams(seed=seed),
                             additional_information={"num_steps": STEPS})
                for (rid, c), (_, seed) in zip(codes.items(), REQUESTS.values())]
    solo = {req.request_id: model.generate_batch([req])[0]["audio"] for req in requests}
    for rid, ref in transformers_audio(ckpt, codes).items():
        frames = codes[rid].numel() * model.dit.repeats
        assert solo[rid].shape == ref.shape == (frames * hop_length(model.bigvgan) + tail,), rid
        torch.testing.assert_close(solo[rid], ref, atol=1e-5, rtol=0, msg=rid)
    for req, out in zip(requests, model.generate_batch(requests)):
        torch.testing.assert_close(out["audio"], solo[req.request_id], atol=1e-6, rtol=0)

    streamed = {rid: torch.cat(audio_of(run_stream(model, open_empty(model, rid, seed, num_steps=STEPS),
                                                   codes[rid], [1] * codes[rid].numel())))
                for rid, (_, seed) in REQUESTS.items()}
    assert torch.equal(streamed["short"], solo["short"])  # one window: the whole request's computation
    for rid, wav in streamed.items():  # windows of the ODE: the tolerance of the default-config test
        assert wav.shape == solo[rid].shape, rid
        assert (wav - solo[rid]).abs().max() <= 1e-4 and snr_db(solo[rid], wav) >= 70, rid
    together = {rid: open_empty(model, rid, seed, num_steps=STEPS) for rid, (_, seed) in REQUESTS.items()}
    chunks: dict[str, list[torch.Tensor]] = {rid: [] for rid in together}
    for rid, stream in together.items():
        stream.push(codes[rid], final=True)
    while ready := [rid for rid, s in together.items() if s.ready()]:
        for rid, out in zip(ready, model.decode_streams([together[rid] for rid in ready])):
            chunks[rid].append(out["audio"])
    for rid, wav in streamed.items():
        torch.testing.assert_close(torch.cat(chunks[rid]), wav, atol=1e-6, rtol=0, msg=rid)


@pytest.mark.parametrize("mel_dim, repeats", [(80, 2), (20, 2), (7, 1), (3, 2)])
def test_every_stream_window_starts_from_the_whole_requests_noise(mel_dim, repeats):
    """Codes pushed one by one into a stream (blocks of 3 codes, the default chunking), for
    request lengths around the 16-value groups: the noise of every window the stream makes is
    the rows of transformers' one draw for the request's final length (the stream's mel is not
    what this checks: zeros)."""
    geometry = StreamGeometry(Token2WavStreamConfig(past_blocks=1, future_blocks=1, vocoder_context_frames=0),
                              block_frames=3 * repeats, repeats=repeats, mel_dim=mel_dim, num_embeds=CODES,
                              settle_codes=settle_codes(repeats, mel_dim))
    totals, windows = [1, 2, 3, 5, 8, 13, 21, 40], 0
    for total in totals:
        whole = whole_noise(new_generator(total), total * repeats, mel_dim)
        stream = Token2WavStream("r", "Chelsie", STEPS, total, geometry)
        for i in range(total):
            stream.push(codes_of(1, i), final=i == total - 1)
            while stream.ready():
                window = stream.next_dit_window()
                start = stream.consumed * repeats - window.keep_from
                assert torch.equal(window.noise, whole[start: start + window.noise.shape[0]]), (total, start)
                stream.commit(window, stream.vocoder_window(window, torch.zeros(window.noise.shape)))
                windows += 1
        assert stream.finished, total
    assert windows > len(totals)  # the longer requests take several windows


@pytest.mark.parametrize("bad, reason", [
    (dict(bigvgan_upsample_kernel_sizes=[4, 8]), "kernel 4 < its rate 5"),
    (dict(bigvgan_resblock_kernel_sizes=[4]), "resblock_kernel_sizes .4. must be odd"),
])
def test_vocoders_transformers_cannot_run_are_refused_at_load(tiny_model, bad, reason):
    """Configurations transformers builds but fails on at every request: refused when the stage
    loads, with the reason, instead of failing each request."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    ckpt = tiny_model("qwen2_5_omni", **bad)
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    with pytest.raises(RuntimeError), torch.no_grad():
        hf.token2wav.code2wav_bigvgan_model(torch.zeros(1, 80, 4))
    with pytest.raises(ValueError, match=reason):
        Qwen2_5OmniToken2Wav.load(str(ckpt))
