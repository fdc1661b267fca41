"""The embedded demo's behaviour is a property of its weights (testing/demo_model.py), so
transformers shows it too: the thinker says whole words only, the talker speaks one code per
word and then stops, the two voices speak different codes; its own deploy file makes replies short."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.config import load_pipeline_config
from vllm_omni.testing.demo_model import DEFAULT_REPLY_TOKENS, demo_words
from vllm_omni.testing.tiny_omni import SPEAKER_BOS_TOKENS


@pytest.fixture(scope="module")
def demo(tiny_model):
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    path = tiny_model("qwen2_5_omni_demo")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_thinker_says_words_only(demo, temperature):
    _, model, tokenizer = demo
    words = demo_words(tokenizer)
    assert len(words) >= 20 and all(t.startswith(" ") and t[1:].isalpha() for t in words.values())
    ids = chat_ids(tokenizer, "Tell me a long story about the sea, please!")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.thinker.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                     do_sample=temperature > 0, temperature=temperature or None, top_k=0, top_p=1.0)
    reply = out[0, ids.shape[1]:].tolist()
    assert set(reply) <= set(words), tokenizer.decode(reply)


def test_the_talker_speaks_one_code_per_word_in_each_voice(demo):
    _, model, tokenizer = demo
    ids = chat_ids(tokenizer, "Hello!")
    codes = {}
    for speaker in SPEAKER_BOS_TOKENS:
        captured = []
        # The codes are what is checked here; the vocoder's waveform is the server tests' part.
        model.token2wav.forward = lambda code, **kw: captured.append(code) or torch.zeros(1)
        torch.manual_seed(0)
        with torch.no_grad():
            text, _ = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker=speaker,
                                     thinker_max_new_tokens=12, thinker_do_sample=False, talker_max_new_tokens=100,
                                     thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                     talker_eos_token_id=[model.config.talker_config.tts_codec_end_token_id,
                                                          model.config.talker_config.tts_codec_pad_token_id])
        del model.token2wav.forward
        assert text.shape[1] - ids.shape[1] == 12
        codes[speaker] = captured[0][0].tolist()
        assert len(codes[speaker]) == 12  # one code per word, then codec end
    first, second = codes.values()
    assert sum(a != b for a, b in zip(first, second)) >= 6


def test_its_own_deploy_settings_make_replies_short(demo):
    path, _, _ = demo
    for modalities in (None, ["text"]):
        thinker = load_pipeline_config(model=str(path), platform="cpu", output_modalities=modalities).stages[0]
        assert thinker.default_sampling_params.max_tokens == DEFAULT_REPLY_TOKENS


def test_the_text_demo_says_words_only(tiny_model):
    # README's LLM example (`demo_model_path("qwen3")`): sampled at its temperature, words, not bytes.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model("qwen3_demo")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Hello, my name is", return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=True,
                             temperature=0.8, top_k=0, top_p=1.0)
    reply = out[0, ids.shape[1]:].tolist()
    assert len(reply) == 40 and set(reply) <= set(demo_words(tokenizer)), tokenizer.decode(reply)
