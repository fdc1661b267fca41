"""The tiny random Qwen2.5-Omni checkpoint: loads in transformers, runs text + audio generate,
stays decisive (diverse outputs), and honours config overrides."""

import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

from vllm_omni.multimodal.chat_template import QWEN2_5_OMNI_SYSTEM_PROMPT
from vllm_omni.testing.tiny_models import make_tiny_model
from vllm_omni.testing.tiny_omni_config import CODEC_END, CODEC_PAD

PROMPTS = ["Hello", "What is the capital of France?", "Once upon a time"]


@pytest.fixture(scope="module")
def omni(tiny_model):
    path = tiny_model("qwen2_5_omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def capture_codes(model):
    """Record the codes the talker hands to token2wav (generate returns only text and audio)."""
    codes, forward = [], model.token2wav.forward

    def hook(code, **kwargs):
        codes.append(code[0].tolist())
        return forward(code, **kwargs)

    model.token2wav.forward = hook
    return codes


def chat_ids(tok, content):
    messages = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, return_tensors="pt")


def test_reference_generate_text_and_audio(omni):
    path, model, tok = omni
    codes = capture_codes(model)
    texts = []
    for prompt in PROMPTS:
        inputs = chat_ids(tok, prompt)
        torch.manual_seed(0)  # token2wav starts from noise
        text_ids, wav = model.generate(
            **inputs, speaker="Chelsie", thinker_max_new_tokens=20, thinker_do_sample=False,
            thinker_eos_token_id=None, talker_max_new_tokens=40, talker_do_sample=False,
            talker_eos_token_id=[CODEC_END, CODEC_PAD], token2wav_num_steps=2,
        )
        new = text_ids[0, inputs["input_ids"].shape[1]:].tolist()
        texts.append(new)
        # Neither the thinker's text nor the talker's codes collapse into a repeated token.
        assert len(new) == 20 and len(set(new)) >= 10 and len(set(new[10:])) >= 5, new
        assert len(codes[-1]) >= 30 and len(set(codes[-1])) >= 10, codes[-1]
        assert wav.ndim == 1 and torch.isfinite(wav).all() and 0.005 < wav.std() < 0.5
    assert len({tuple(t) for t in texts}) == len(PROMPTS)
    assert len({tuple(c) for c in codes}) == len(PROMPTS)


def test_token2wav_depends_on_codes_and_speaker(omni):
    """Tests comparing token2wav implementations must see a wrong code or speaker path."""
    _, model, _ = omni
    gen = torch.Generator().manual_seed(1)
    codes_a, codes_b = (torch.randint(0, CODEC_PAD, (1, 30), generator=gen) for _ in range(2))

    def wav(code, speaker):
        spk = model.speaker_map[speaker]
        torch.manual_seed(0)  # same start noise
        with torch.no_grad():
            return model.token2wav(code, conditioning=spk["cond"], reference_mel=spk["ref_mel"], num_steps=2)

    base = wav(codes_a, "Chelsie")
    for other in (wav(codes_b, "Chelsie"), wav(codes_a, "Ethan")):
        assert (base - other).std() > 0.03 * base.std()
    assert (base.abs() < 0.999).float().mean() > 0.99  # not clipped to +-1


def test_side_files(omni):
    path, model, tok = omni
    speakers = torch.load(path / "spk_dict.pt", weights_only=True)
    assert set(speakers) == {"Chelsie", "Ethan"}
    dit = model.config.token2wav_config.dit_config
    for spk in speakers.values():
        assert spk["cond"].shape == (1, dit.enc_emb_dim) and spk["ref_mel"].shape[::2] == (1, dit.mel_dim)
        assert isinstance(spk["bos_token"], int) and spk["bos_token"] < len(tok)
    fe = WhisperFeatureExtractor.from_pretrained(path)
    assert (fe.feature_size, fe.sampling_rate, fe.n_samples) == (128, 16000, 4800000)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (14, 2, 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "video"},
                                      {"type": "text", "text": "?"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text == (
        f"<|im_start|>system\n{QWEN2_5_OMNI_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
        "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>"
        "<|vision_bos|><|VIDEO|><|vision_eos|>?<|im_end|>\n<|im_start|>assistant\n"
    )
    thinker = model.config.thinker_config
    assert thinker.audio_token_index == tok.convert_tokens_to_ids("<|AUDIO|>")
    assert thinker.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_bos|>")


def test_multimodal_reference_generate(omni):
    """The notes' reference generate with image + audio in and text + audio out."""
    from tests.multimodal.hf_reference import make_reference
    from tests.multimodal.media_files import image_bytes, sine
    from vllm_omni.multimodal.media import load_image

    path, model, tok = omni
    proc = make_reference(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    image, wave = load_image(image_bytes()), sine(1.0, 16000)[:, 0]
    inputs = proc(text=text, images=[image], audio=[wave], return_tensors="pt")
    torch.manual_seed(0)
    text_ids, wav = model.generate(
        input_ids=inputs["input_ids"], thinker_pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"], input_features=inputs["input_features"],
        feature_attention_mask=inputs["feature_attention_mask"], speaker="Ethan",
        thinker_max_new_tokens=8, thinker_do_sample=False, talker_max_new_tokens=16,
        talker_do_sample=False, talker_eos_token_id=[CODEC_END, CODEC_PAD], token2wav_num_steps=2,
    )
    assert text_ids.shape[1] > inputs["input_ids"].shape[1] and wav.numel() > 0


def test_overrides(tiny_model):
    path = tiny_model(
        "qwen2_5_omni", thinker_hidden_size=96, thinker_config={"text_config": {"num_hidden_layers": 3}},
        talker_num_hidden_layers=2, vision_depth=2,
    )
    cfg = json.loads((path / "config.json").read_text())
    thinker, talker = cfg["thinker_config"], cfg["talker_config"]
    text = thinker["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"]) == (96, 3)
    # derived so the model still fits together: encoders' outputs, talker input, M-RoPE split
    assert thinker["audio_config"]["output_dim"] == thinker["vision_config"]["out_hidden_size"] == 96
    assert talker["embedding_size"] == 96 and talker["num_hidden_layers"] == 2
    assert sum(text["rope_parameters"]["mrope_section"]) == 96 // 4 // 2
    assert thinker["vision_config"]["depth"] == 2
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    inputs = chat_ids(tok, "Hi")
    torch.manual_seed(0)
    _, wav = model.generate(
        **inputs, thinker_max_new_tokens=4, thinker_do_sample=False, talker_max_new_tokens=8,
        talker_do_sample=False, talker_eos_token_id=[CODEC_END, CODEC_PAD], token2wav_num_steps=2,
    )
    assert wav.numel() > 0


def test_override_errors_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown qwen2_5_omni override 'hidden_size'"):
        make_tiny_model("qwen2_5_omni", tmp_path / "a", hidden_size=96)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['hiden_size'\]"):
        make_tiny_model("qwen2_5_omni", tmp_path / "b", thinker_hiden_size=96)
    with pytest.raises(ValueError, match="dit_config"):
        make_tiny_model("qwen2_5_omni", tmp_path / "c", token2wav_config={"dit_config": {"foo": 1}})
    path = make_tiny_model("qwen2_5_omni", tmp_path / "d", dtype="bfloat16", enable_audio_output=False)
    from safetensors.torch import load_file

    weights = load_file(path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert {k.split(".")[0] for k in weights} == {"thinker"}
    assert (path / "spk_dict.pt").is_file()  # from_pretrained wants it even without a talker
