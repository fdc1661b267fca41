"""Qwen2.5-Omni end to end: `Omni(model=<checkpoint>)` with the bundled configs, real stage
processes (thinker -> talker -> code2wav), the tiny random checkpoint.

- 8 concurrent mixed-modality requests each equal their solo run (text tokens identical,
  codec codes identical, waveform within 1e-4);
- text, codes and waveform equal transformers' `Qwen2_5OmniForConditionalGeneration.generate`
  (also on other shapes, whose pipeline runs its stages as threads);
- `modalities` returns only what was asked and runs only the stages it needs;
- bad prompts fail in generate, before anything is queued.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import in_threads
from tests.e2e.conftest import by_request, mixed_prompts, short_params, user
from tests.reference.hf_talker import give_talker_a_mask
from vllm_omni import Omni

SAMPLE_RATE = 24000


@pytest.fixture(scope="module")
def omni(omni25):
    """The package's Qwen2.5-Omni pipeline (real stage processes, tests/e2e/conftest.py)."""
    return omni25


def stage_requests(omni) -> list[int]:
    """How many requests each stage has finished (the orchestrator's counters)."""
    return [omni._runtime.orchestrator.stage_counters[s]["requests"] for s in range(3)]


def check_same(got: dict, solo: dict, where: str) -> None:
    text, ref_text = got["text"].request_output.outputs[0], solo["text"].request_output.outputs[0]
    assert text.token_ids == ref_text.token_ids and text.text == ref_text.text, where
    audio, ref_audio = got["audio"].request_output, solo["audio"].request_output
    assert audio.prompt_token_ids == ref_audio.prompt_token_ids, where  # the talker's codes
    torch.testing.assert_close(audio.outputs[0].multimodal_output["audio"],
                               ref_audio.outputs[0].multimodal_output["audio"], atol=1e-4, rtol=0, msg=where)


def test_mixed_concurrent_requests_equal_their_solo_runs(omni):
    prompts = mixed_prompts()
    params = short_params()
    together = by_request(omni.generate(prompts, params, use_tqdm=False))
    assert len(together) == 8
    for i, outs in enumerate(together):
        assert sorted(outs) == ["audio", "text"] and all(o.finished and o.error is None for o in outs.values()), i
        wav = outs["audio"].request_output.outputs[0].multimodal_output["audio"]
        assert wav.dtype == torch.float32 and wav.dim() == 1 and wav.numel() > 0 and torch.isfinite(wav).all()
        # 2 mel frames per codec code, 20 samples per frame (the tiny vocoder) -> 24 kHz audio.
        assert wav.numel() == 40 * len(outs["audio"].request_output.prompt_token_ids)
    for i, prompt in enumerate(prompts):
        [solo] = by_request(omni.generate(prompt, params, use_tqdm=False))
        check_same(together[i], solo, f"prompt {i}")
    # The speaker is honoured: the same request with another voice speaks differently.
    ethan = together[1]["audio"].request_output.outputs[0].multimodal_output["audio"]
    [chelsie] = by_request(omni.generate({**prompts[1], "speaker": "Chelsie"}, params, use_tqdm=False))
    assert not torch.allclose(chelsie["audio"].request_output.outputs[0].multimodal_output["audio"], ethan)


def test_matches_transformers_generate(omni, omni_dir):
    check_matches_transformers(omni, omni_dir, talker_tokens=40)


# Other shapes than the default tiny model's: grouped-query thinker attention with another
# head_dim, DiT blocks of 4 codes with two look-ahead layers (the streamed token2wav decodes
# many small chunks), a three-stage vocoder.
OTHER_SHAPES = dict(thinker_hidden_size=96, thinker_num_attention_heads=2, thinker_num_key_value_heads=1,
                    thinker_num_hidden_layers=3, dit_block_size=8, dit_num_hidden_layers=3,
                    dit_look_ahead_layers=[0, 2], dit_look_backward_layers=[1], bigvgan_upsample_rates=[4, 3, 2],
                    bigvgan_upsample_kernel_sizes=[8, 6, 4])


def test_other_shapes_stream_what_transformers_generates(tiny_model):
    ckpt = tiny_model("qwen2_5_omni", **OTHER_SHAPES)
    with Omni(model=str(ckpt), stage_overrides=in_threads(3)) as omni:  # the bundled deploy config: every edge streams
        check_matches_transformers(omni, ckpt, talker_tokens=60)
        assert omni._runtime.orchestrator.stage_counters[2]["early_starts"] == 1


def check_matches_transformers(omni, ckpt, talker_tokens: int) -> None:
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from vllm_omni.testing.tiny_omni_config import CODEC_END, CODEC_PAD

    messages = user({"type": "text", "text": "What is the capital of France?"})
    thinker_tokens, seed, steps = 12, 7, 10  # steps: code2wav's default
    greedy = [{"temperature": 0.0, "max_tokens": thinker_tokens, "repetition_penalty": 1.0},
              {"temperature": 0.0, "max_tokens": talker_tokens, "repetition_penalty": 1.05},
              {"seed": seed}]
    ours = by_request(omni.generate({"messages": messages, "speaker": "Chelsie"}, greedy, use_tqdm=False))[0]

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              return_tensors="pt")["input_ids"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.talker.register_forward_pre_hook(give_talker_a_mask, with_kwargs=True)
    codes, token2wav = [], model.token2wav.forward

    def seeded_token2wav(code, **kwargs):  # our code2wav draws its noise from the request seed
        codes.append(code[0].tolist())
        torch.manual_seed(seed)
        return token2wav(code, **kwargs)

    model.token2wav.forward = seeded_token2wav
    with torch.no_grad():
        sequences, wav = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Chelsie",
            thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False,
            talker_max_new_tokens=talker_tokens, talker_do_sample=False,
            talker_eos_token_id=[CODEC_END, CODEC_PAD], token2wav_num_steps=steps,
            # transformers' thinker does not read the checkpoint's generation config (both ids).
            thinker_eos_token_id=tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    text = ours["text"].request_output
    assert text.prompt_token_ids == ids[0].tolist()  # same chat template, same ids
    assert text.outputs[0].token_ids == sequences[0, ids.shape[1]:].tolist()
    assert ours["audio"].request_output.prompt_token_ids == codes[0] and len(codes[0]) > 10
    ours_wav = ours["audio"].request_output.outputs[0].multimodal_output["audio"]
    torch.testing.assert_close(ours_wav, wav.reshape(-1).float(), atol=1e-4, rtol=0)


def test_modalities_select_outputs_and_stages(omni):
    prompt = {"messages": user({"type": "text", "text": "Hi"})}
    params = short_params()
    [full] = by_request(omni.generate(prompt, params, use_tqdm=False))
    before = stage_requests(omni)
    text_only = omni.generate(prompt, params, use_tqdm=False, modalities=["text"])
    assert [o.final_output_type for o in text_only] == ["text"]
    assert stage_requests(omni) == [before[0] + 1, before[1], before[2]]  # talker and code2wav never ran
    assert text_only[0].request_output.outputs[0].token_ids == full["text"].request_output.outputs[0].token_ids
    audio_only = omni.generate(prompt, params, use_tqdm=False, modalities=["audio"])
    assert [o.final_output_type for o in audio_only] == ["audio"]
    assert stage_requests(omni) == [before[0] + 2, before[1] + 1, before[2] + 1]
    torch.testing.assert_close(audio_only[0].request_output.outputs[0].multimodal_output["audio"],
                               full["audio"].request_output.outputs[0].multimodal_output["audio"], atol=1e-4, rtol=0)
    # Without streaming, an output's delta is the whole output.
    assert text_only[0].delta.token_ids == text_only[0].request_output.outputs[0].token_ids
    assert omni.output_modalities == ["text", "audio"]
    with pytest.raises(ValueError, match=r"'image' is not available; this pipeline produces \['text', 'audio'\]"):
        omni.generate(prompt, modalities=["image"])


@pytest.mark.parametrize("bad, match", [
    ({"messages": user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})}, "image"),
    ({"messages": user({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}})}, "base64"),
    ({"prompt": "Look: <|vision_bos|><|IMAGE|><|vision_eos|>"}, "1 image placeholder"),
    ({"prompt": "Hi", "speaker": "Nobody"}, "unknown speaker 'Nobody'"),
    ({"prompt": "Hi", "mm_processor_kwargs": {"fps": 0}}, "positive"),
    ({"messages": user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})}, "video"),
])
def test_bad_prompts_fail_before_anything_is_queued(omni, bad, match):
    before = stage_requests(omni)
    with pytest.raises(ValueError, match=match):
        omni.generate(["A good prompt.", bad], short_params(), use_tqdm=False)  # the good one is not run either
    assert stage_requests(omni) == before
