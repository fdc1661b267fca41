"""Qwen3-Omni end to end: `Omni(model=<checkpoint>)` with the bundled configs, real stage
processes (thinker -> talker with code predictor -> code2wav), the tiny random checkpoint.

- 8 concurrent requests (text, audio+text, image+text) each equal their solo run: text tokens
  identical, every code group of every frame identical, waveform within 1e-4;
- text, codes and waveform equal transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
  (also on other shapes, whose pipeline runs its stages as threads);
- `modalities=["text"]` runs the thinker alone; `output_modalities=["text"]` loads the
  thinker-only variant;
- the voice comes from config.json's `talker_config.speaker_id` and reaches the talker.
"""
from __future__ import annotations

import base64

import pytest
import torch

from tests.conftest import in_threads
from tests.e2e.conftest import by_request, data_url, user
from tests.multimodal.media_files import audio_bytes, image_bytes, sine
from vllm_omni import Omni

# Thinker tokens and talker frames: small, the tiny talker never picks codec EOS by itself.
PARAMS = [{"max_tokens": 8}, {"max_tokens": 16}, None]


@pytest.fixture(scope="module")
def ckpt(qwen3_omni_voices_dir):
    return qwen3_omni_voices_dir


@pytest.fixture(scope="module")
def omni(omni3):
    """The package's Qwen3-Omni pipeline (real stage processes, tests/e2e/conftest.py)."""
    return omni3


def stage_requests(omni) -> list[int]:
    """How many requests each stage has finished (the orchestrator's counters)."""
    return [omni._runtime.orchestrator.stage_counters[s]["requests"] for s in range(3)]


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def mixed_prompts() -> list:
    """8 chat prompts across text, audio+text and image+text, in the shapes clients use. The
    talker speaks the assistant turn of a chat prompt, so every prompt is one (a raw string
    without `<|im_start|>assistant` is refused by the talker)."""
    wav = audio_bytes("WAV", seconds=0.8, sr=22050, channels=1)
    png = image_bytes("PNG", size=(90, 60), seed=1)
    return [
        {"messages": user(text("Tell me a story."))},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
         "speaker": "Ethan"},
        {"messages": user({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                                   "format": "wav"}}, text("What is this?"))},
        {"messages": user({"type": "audio", "audio": (sine(0.5, 16000)[:, 0], 16000)}, text("Transcribe.")),
         "speaker": "chelsie"},
        {"messages": user({"type": "image_url", "image_url": {"url": data_url("image/png", png)}},
                          text("Describe the image."))},
        # vLLM style: a template-form prompt with a placeholder + multi_modal_data.
        {"prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n"
                   "<|im_start|>assistant\n",
         "multi_modal_data": {"image": png}, "speaker": "Chelsie"},
        {"messages": user({"type": "image_url", "image_url": {"url": data_url("image/png", png)}},
                          {"type": "audio", "audio": (sine(0.3, 16000)[:, 0], 16000)}, text("Both?"))},
        {"messages": user(text("Why is the sky blue?"))},
    ]


def audio_of(out) -> torch.Tensor:
    return out["audio"].request_output.outputs[0].multimodal_output["audio"]


def check_same(got: dict, solo: dict, where: str) -> None:
    txt, ref_txt = got["text"].request_output.outputs[0], solo["text"].request_output.outputs[0]
    assert txt.token_ids == ref_txt.token_ids and txt.text == ref_txt.text, where
    # code2wav's prompt is every code group of every frame, codebook-major (talker2code2wav).
    codes, ref_codes = got["audio"].request_output.prompt_token_ids, solo["audio"].request_output.prompt_token_ids
    assert codes == ref_codes, where
    torch.testing.assert_close(audio_of(got), audio_of(solo), atol=1e-4, rtol=0, msg=where)


def test_mixed_concurrent_requests_equal_their_solo_runs(omni):
    prompts = mixed_prompts()
    together = by_request(omni.generate(prompts, PARAMS, use_tqdm=False))
    assert len(together) == 8
    for i, outs in enumerate(together):
        assert sorted(outs) == ["audio", "text"] and all(o.finished and o.error is None for o in outs.values()), i
        wav = audio_of(outs)
        assert wav.dtype == torch.float32 and wav.dim() == 1 and wav.numel() > 0 and torch.isfinite(wav).all()
        assert int(outs["audio"].request_output.outputs[0].multimodal_output["sample_rate"]) == 24000
        # 4 code groups per frame, one frame per talker step (no EOS: its length limit).
        assert len(outs["audio"].request_output.prompt_token_ids) == 4 * 16, i
    for i, prompt in enumerate(prompts):
        [solo] = by_request(omni.generate(prompt, PARAMS, use_tqdm=False))
        check_same(together[i], solo, f"prompt {i}")
    # The voice reaches the talker: the same request with another voice speaks differently.
    [other] = by_request(omni.generate({**prompts[1], "speaker": "Chelsie"}, PARAMS, use_tqdm=False))
    assert other["text"].request_output.outputs[0].token_ids == together[1]["text"].request_output.outputs[0].token_ids
    assert other["audio"].request_output.prompt_token_ids != together[1]["audio"].request_output.prompt_token_ids


def reference_inputs(ckpt, messages) -> tuple[torch.Tensor, dict]:
    """transformers' inputs for a chat prompt: ids from the tokenizer's own chat template, or
    (with media) our processor's ids and tensors (tests/multimodal checks them against
    transformers' processor)."""
    from transformers import AutoTokenizer

    from vllm_omni.multimodal.qwen3_omni_processor import Qwen3OmniInputProcessor

    if all(isinstance(part, str) or part["type"] == "text" for m in messages for part in m["content"]):
        tok = AutoTokenizer.from_pretrained(ckpt)
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  return_tensors="pt")["input_ids"]
        return ids, {}
    processed = Qwen3OmniInputProcessor.from_pretrained(ckpt).process_messages(messages)
    return torch.tensor([processed.prompt_token_ids]), dict(processed.mm_inputs)


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")
@pytest.mark.parametrize("messages", [
    user(text("What is the capital of France?")),
    user({"type": "image", "image": image_bytes("PNG", size=(64, 64), seed=2)},
         {"type": "audio", "audio": (sine(0.6, 16000)[:, 0], 16000)}, text("What do you see and hear?")),
], ids=["text", "image+audio"])
def test_matches_transformers_generate(omni, ckpt, messages):
    check_matches_transformers(omni, ckpt, messages, talker_tokens=20)


# Other shapes than the default tiny model's: 8 code groups of a 32-code codebook, a code
# predictor of 3 grouped-query layers with another head_dim, a code2wav with another sliding
# window and upsampling (other chunk sizes in samples), 8 thinker experts of which 3 are active.
OTHER_SHAPES = dict(code2wav_num_quantizers=8, code2wav_codebook_size=32, code_predictor_num_hidden_layers=3,
                    code_predictor_num_attention_heads=4, code_predictor_num_key_value_heads=2,
                    code_predictor_head_dim=8, code2wav_sliding_window=8, code2wav_upsample_rates=[2, 3],
                    code2wav_upsampling_ratios=[2, 2], thinker_num_experts=8, thinker_num_experts_per_tok=3)


def test_other_shapes_stream_what_transformers_generates(tiny_model):
    ckpt = tiny_model("qwen3_omni_moe", **OTHER_SHAPES)
    with Omni(model=str(ckpt), stage_overrides=in_threads(3)) as omni:  # the bundled deploy config: every edge streams
        check_matches_transformers(omni, ckpt, user(text("What is the capital of France?")), talker_tokens=30)
        assert omni._runtime.orchestrator.stage_counters[2]["early_starts"] == 1


def check_matches_transformers(omni, ckpt, messages, talker_tokens: int) -> None:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from vllm_omni.testing.tiny_qwen3_omni import prepare_reference

    thinker_tokens = 10
    greedy = [{"temperature": 0.0, "max_tokens": thinker_tokens, "repetition_penalty": 1.0},
              {"temperature": 0.0, "max_tokens": talker_tokens, "repetition_penalty": 1.05}, None]
    ours = by_request(omni.generate({"messages": messages, "speaker": "Chelsie"}, greedy, use_tqdm=False))[0]

    ids, mm = reference_inputs(ckpt, messages)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    prepare_reference(model)  # the notes' workaround: the talker reads an audio config it lacks
    talker_generate, talker_runs = model.talker.generate, []

    def recording_talker(*args, **kwargs):
        talker_runs.append(talker_generate(*args, **kwargs))
        return talker_runs[-1]

    model.talker.generate = recording_talker
    # The checkpoint's generation config's ids (transformers' default is the released
    # vocabulary's <|im_end|>, outside the tiny one).
    thinker_eos = AutoTokenizer.from_pretrained(ckpt).convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    with torch.no_grad():
        # transformers computes no frame for the talker's last sampled token; our talker, stopped
        # by its length limit, keeps that token's frame. One more talker step makes the frames
        # (and so the waveform) the same.
        sequences, wav = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Chelsie", **mm,
            thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False, thinker_eos_token_id=thinker_eos,
            talker_max_new_tokens=talker_tokens + 1, talker_do_sample=False)
    [talker] = talker_runs
    ref_frames = torch.stack([h[-1] for h in talker.hidden_states if h[-1] is not None], dim=1)[0]  # [frames, G]
    assert ref_frames.shape == (talker_tokens, model.config.talker_config.num_code_groups)

    txt = ours["text"].request_output
    assert txt.prompt_token_ids == ids[0].tolist()
    assert txt.outputs[0].token_ids == sequences[0, ids.shape[1]:].tolist()
    codes = ours["audio"].request_output.prompt_token_ids
    assert codes == ref_frames.T.reshape(-1).tolist()  # every code group of every frame
    torch.testing.assert_close(audio_of(ours), wav.reshape(-1).float(), atol=1e-4, rtol=0)


def test_text_modality_runs_only_the_thinker(omni):
    prompt = {"messages": user(text("Hi"))}
    [full] = by_request(omni.generate(prompt, PARAMS, use_tqdm=False))
    before = stage_requests(omni)
    text_only = omni.generate(prompt, PARAMS, use_tqdm=False, modalities=["text"])
    assert [o.final_output_type for o in text_only] == ["text"]
    assert stage_requests(omni) == [before[0] + 1, before[1], before[2]]  # talker and code2wav never ran
    assert text_only[0].request_output.outputs[0].token_ids == full["text"].request_output.outputs[0].token_ids
    audio_only = omni.generate(prompt, PARAMS, use_tqdm=False, modalities=["audio"])
    assert [o.final_output_type for o in audio_only] == ["audio"]
    assert stage_requests(omni) == [before[0] + 2, before[1] + 1, before[2] + 1]
    torch.testing.assert_close(audio_of({"audio": audio_only[0]}), audio_of(full), atol=1e-4, rtol=0)
    assert omni.output_modalities == ["text", "audio"]


def test_raw_prompt_has_no_turn_to_speak(omni):
    """A raw string is tokenized as is (vLLM's rule): the thinker answers it, the talker, which
    speaks the assistant turn, fails that request alone with a clear error."""
    reply, failed = omni.generate("Tell me a story.", PARAMS, use_tqdm=False)  # the reply, then the error
    assert reply.final_output_type == "text" and reply.request_output.error is None
    assert len(reply.request_output.outputs[0].token_ids) == 8
    assert "no '<|im_start|>assistant' turn" in failed.request_output.error
    [text_only] = omni.generate("Tell me a story.", PARAMS, use_tqdm=False, modalities=["text"])
    assert text_only.request_output.outputs[0].token_ids == reply.request_output.outputs[0].token_ids


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "Hi", "speaker": "Nobody"}, r"unknown speaker 'Nobody'; available: \['chelsie', 'ethan'\]"),
    ({"prompt": "Look: <|vision_start|><|image_pad|><|vision_end|>"}, "1 image placeholder"),
    ({"messages": user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})}, "image"),
])
def test_bad_prompts_fail_before_anything_is_queued(omni, bad, match):
    before = stage_requests(omni)
    with pytest.raises(ValueError, match=match):
        omni.generate([{"messages": user(text("A good prompt."))}, bad], PARAMS, use_tqdm=False)
    assert stage_requests(omni) == before


def test_text_output_loads_the_thinker_only_variant(omni, ckpt):
    prompt = {"messages": user(text("Hello there"))}
    [full] = by_request(omni.generate(prompt, PARAMS, use_tqdm=False))
    with Omni(model=str(ckpt), output_modalities=["text"], stage_overrides=in_threads(1)) as thinker_only:
        assert thinker_only._runtime.pipeline.pipeline_name == "qwen3_omni_moe_thinker_only"
        assert thinker_only.output_modalities == ["text"]
        [out] = thinker_only.generate(prompt, PARAMS[:1], use_tqdm=False)
    assert out.request_output.outputs[0].token_ids == full["text"].request_output.outputs[0].token_ids
