"""Qwen3-Omni with video in and speech out, on real frame rates and clip lengths.

A video sampled at 29.97 fps, or any 1 s clip (4 frames sampled: 0.5 s per frame group), puts
its frame groups at fractional M-RoPE times (t = 6.5, 13.013, ...). transformers keeps them as
float32 positions in the thinker and in the talker; so must we. Clips are real mp4 files
decoded by our processor (PyAV), compared with transformers (float32, CPU, tiny checkpoint):
the positions of every clip, then the talker's codes for fractional ones, with and without the
video's audio track, and how generated tokens continue fractional positions.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from tests.models.test_qwen3_omni_talker import (check_against_reference, hf_reference, run_talker, talker_engine,
                                                 thinker_output)
from tests.multimodal.media_files import mp4_bytes
from vllm_omni.engine.stage_input import StageView
from vllm_omni.model_executor.models.qwen3_omni.bridges import thinker2talker
from vllm_omni.model_executor.models.qwen3_omni.rope_index import (GeneratedPositions, RopeTokenConfig,
                                                                   qwen3_omni_rope_index)

NTSC = Fraction(30000, 1001)  # 29.97 fps
# (frames per second, seconds): every 29.97 fps clip and every 1 s clip is fractional; 30 fps
# for 2 s is the integral control.
CLIPS = [(NTSC, 1.0), (NTSC, 2.0), (NTSC, 3.0), (Fraction(30), 1.0), (Fraction(25), 1.0),
         (Fraction(24000, 1001), 1.5), (Fraction(30), 2.0)]
SMALL_FRAMES = {"min_pixels": 32 * 32, "max_pixels": 4 * 32 * 32}  # 1 or 2x2 merged patches per frame


@pytest.fixture(scope="module")
def ckpt(tiny_model):
    return tiny_model("qwen3_omni_moe")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni.testing.tiny_qwen3_omni import prepare_reference

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    prepare_reference(model)
    return model


@pytest.fixture(scope="module")
def processor(ckpt):
    from vllm_omni.multimodal.qwen3_omni_processor import Qwen3OmniInputProcessor

    return Qwen3OmniInputProcessor.from_pretrained(ckpt)


def process_clip(processor, fps: Fraction, seconds: float, with_audio: bool):
    video = mp4_bytes(n_frames=round(fps * seconds), fps=fps, size=(64, 64), with_audio=with_audio)
    messages = [{"role": "user", "content": [{"type": "video", "video": video},
                                             {"type": "text", "text": "What happens?"}]}]
    return processor.process_messages(messages, use_audio_in_video=with_audio, video_options=SMALL_FRAMES)


@pytest.mark.parametrize("fps, seconds", CLIPS, ids=[f"{float(f):.2f}fps-{s}s" for f, s in CLIPS])
def test_positions_of_real_clips_match_transformers(hf, processor, fps, seconds):
    result = process_clip(processor, fps, seconds, with_audio=False)
    mm = result.mm_inputs
    ids = torch.tensor([result.prompt_token_ids])
    ref, ref_delta = hf.thinker.model.get_rope_index(ids, None, mm["video_grid_thw"], torch.ones_like(ids), False,
                                                     None, mm["video_second_per_grid"])
    ours, delta = qwen3_omni_rope_index(result.prompt_token_ids, RopeTokenConfig.from_config(hf.config.thinker_config),
                                        video_grid_thw=mm["video_grid_thw"],
                                        second_per_grids=mm["video_second_per_grid"])
    assert torch.equal(ours, ref[:, 0]) and delta == float(ref_delta)
    fractional = not torch.equal(ours, ours.round())
    assert fractional == (fps != 30 or seconds != 2.0)  # the control clip alone is integral


@pytest.mark.parametrize("with_audio", [False, True], ids=["video", "video+its-audio"])
def test_talker_speaks_a_29_97_fps_1s_clip_like_transformers(ckpt, hf, processor, with_audio):
    """The clip the upstream curl script's default request hits: the thinker's reply, then the
    talker's codes for every step and code group, equal transformers' generate."""
    tok = processor.tokenizer
    result = process_clip(processor, NTSC, 1.0, with_audio)
    mm = dict(result.mm_inputs)
    spg = mm["video_second_per_grid"]
    assert not torch.equal(spg * 13, (spg * 13).round())  # the frame times really are fractional
    hf_inputs = {k: v.long() if k == "feature_attention_mask" else v for k, v in mm.items()}
    ref = hf_reference(hf, tok, result.prompt_token_ids, "Ethan", use_audio_in_video=with_audio, **hf_inputs)
    user_prompt = {"prompt_token_ids": result.prompt_token_ids,
                   "additional_information": {**mm, "use_audio_in_video": with_audio}}
    [talker_in] = thinker2talker([StageView(0, [thinker_output("clip", result.prompt_token_ids, ref["thinker"])])],
                                 [0], user_prompt, False)
    ours = run_talker(talker_engine(ckpt), {"clip": talker_in})["clip"]
    check_against_reference("clip", ours, ref)


def test_generated_positions_round_like_transformers_generate():
    """transformers extends position_ids by `arange(1) + position_ids[..., -1:] + 1` after every
    step: a float32 running sum. After a few binade crossings it differs from `last + k` (here
    at k = 15), and the generated positions must follow the running sum."""
    last = torch.full((3, 1), 1.0093601942062378, dtype=torch.float32)
    hf_ids, ours = last.clone(), GeneratedPositions(last)
    for k in range(1, 20):
        hf_ids = torch.cat([hf_ids, torch.arange(1, dtype=hf_ids.dtype) + hf_ids[..., -1:] + 1], dim=-1)
        assert torch.equal(ours.span(k - 1, k), hf_ids[:, -1:]), k
    assert torch.equal(ours.span(0, 19), hf_ids[:, 1:])  # spans are cut from the same columns
    assert not torch.equal(hf_ids[:, 15], (last + 15)[:, 0])  # the case that tells them apart
    integral = GeneratedPositions(torch.tensor([[7], [7], [9]]))
    assert integral.span(2, 4).tolist() == [[10, 11], [10, 11], [12, 13]]
