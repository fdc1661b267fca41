"""The tiny random Qwen3-Omni-MoE checkpoint: loads in transformers, runs the reference generate
(text + audio out, with text / audio / image in), stays decisive, and honours config overrides."""

import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from vllm_omni.testing.tiny_models import make_tiny_model
from vllm_omni.testing.tiny_qwen3_omni import prepare_reference
from vllm_omni.testing.tiny_qwen3_omni_config import codec_ids

PROMPTS = ["Hello", "What is the capital of France?", "Once upon a time"]


@pytest.fixture(scope="module")
def omni(tiny_model):
    path = tiny_model("qwen3_omni_moe")
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()
    prepare_reference(model)  # transformers reads talker.config.audio_config with audio input
    return path, model, AutoTokenizer.from_pretrained(path)


def capture_codes(model):
    """Record the codes the talker hands to code2wav (generate returns only text and audio)."""
    codes, decode = [], model.code2wav.chunked_decode

    def hook(code, **kwargs):
        codes.append(code[0])
        return decode(code, **kwargs)

    model.code2wav.chunked_decode = hook
    return codes


def chat_ids(tok, content):
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok(text, return_tensors="pt")


def generate(model, tok, inputs, thinker_tokens, talker_tokens, **kwargs):
    return model.generate(
        **inputs, speaker="Ethan", thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False,
        # the default eos is the released vocabulary's <|im_end|> (151645): outside the tiny one
        thinker_eos_token_id=kwargs.pop("thinker_eos_token_id", tok.convert_tokens_to_ids("<|im_end|>")),
        talker_max_new_tokens=talker_tokens, talker_do_sample=False, **kwargs,
    )


def test_reference_generate_text_and_audio(omni):
    path, model, tok = omni
    codes = capture_codes(model)
    texts = []
    for prompt in PROMPTS:
        inputs = chat_ids(tok, prompt)
        # As many text tokens as codes: the talker reads one text position per code, and past
        # the text it only gets padding (its codes then narrow, as expected).
        text_ids, wav = generate(model, tok, inputs, 24, 24, thinker_eos_token_id=None)
        new = text_ids[0, inputs["input_ids"].shape[1]:].tolist()
        texts.append(new)
        # Neither the thinker's text nor any code group collapses into a repeated token.
        assert len(new) == 24 and len(set(new)) >= 12 and len(set(new[12:])) >= 6, new
        group_codes = codes[-1]  # [num_code_groups, T]
        assert group_codes.shape[0] == 4 and group_codes.shape[1] >= 20
        for group in group_codes.tolist():  # measured: >= 14 and >= 8
            assert len(set(group)) >= 8 and len(set(group[12:])) >= 4, group
        assert wav.shape[:2] == (1, 1) and torch.isfinite(wav).all() and 0.005 < wav.std() < 0.5
    assert len({tuple(t) for t in texts}) == len(PROMPTS)
    assert len({tuple(c.flatten().tolist()) for c in codes}) == len(PROMPTS)


def test_code2wav_depends_on_codes(omni):
    """Tests comparing code2wav implementations must see a wrong code path."""
    _, model, _ = omni
    gen = torch.Generator().manual_seed(1)
    codes_a, codes_b = (torch.randint(0, 64, (1, 4, 30), generator=gen) for _ in range(2))
    with torch.no_grad():
        wav_a, wav_b = model.code2wav(codes_a), model.code2wav(codes_b)
    assert (wav_a - wav_b).std() > 0.3 * wav_a.std()
    assert (wav_a.abs() < 0.999).float().mean() > 0.99  # not clipped to +-1


def test_side_files_and_ids(omni):
    path, model, tok = omni
    assert (tok.audio_token, tok.image_token, tok.video_token) == ("<|audio_pad|>", "<|image_pad|>", "<|video_pad|>")
    assert (tok.audio_bos_token, tok.vision_eos_token) == ("<|audio_start|>", "<|vision_end|>")
    for word in ["system", "user", "assistant"]:  # the talker finds turns by these single ids
        assert len(tok("<|im_start|>" + word)["input_ids"]) == 2, word
    fe = WhisperFeatureExtractor.from_pretrained(path)
    assert (fe.feature_size, fe.sampling_rate) == (128, 16000)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    assert pre["image_mean"] == pre["image_std"] == [0.5] * 3
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "video"},
                                      {"type": "text", "text": "?"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|image_pad|>"
        "<|vision_end|><|vision_start|><|video_pad|><|vision_end|>?<|im_end|>\n<|im_start|>assistant\n"
    )
    config, ids = model.config, tok.convert_tokens_to_ids
    assert config.thinker_config.audio_token_id == ids("<|audio_pad|>")
    assert config.thinker_config.vision_start_token_id == ids("<|vision_start|>")
    assert (config.user_token_id, config.assistant_token_id) == (ids("user"), ids("assistant"))
    assert config.talker_config.speaker_id == codec_ids(64)["speaker_id"]
    assert config.thinker_config.audio_config.n_window == 50


def test_multimodal_reference_generate(omni):
    """The reference generate with audio + image in (prepared by our processor), text + audio out."""
    from tests.multimodal.media_files import image_bytes, sine
    from vllm_omni.multimodal.media import load_image
    from vllm_omni.multimodal.qwen3_omni_processor import Qwen3OmniInputProcessor

    path, model, tok = omni
    prompt = Qwen3OmniInputProcessor.from_pretrained(path).process_messages([{"role": "user", "content": [
        {"type": "image", "image": load_image(image_bytes())}, {"type": "audio", "audio": sine(1.5, 16000)[:, 0]},
        {"type": "text", "text": "Hi"},
    ]}])
    inputs = {"input_ids": torch.tensor([prompt.prompt_token_ids]), **prompt.mm_inputs}
    text_ids, wav = generate(model, tok, inputs, 8, 12, thinker_eos_token_id=None)
    assert text_ids.shape[1] == inputs["input_ids"].shape[1] + 8
    assert wav.numel() > 0 and torch.isfinite(wav).all()


def test_overrides(tiny_model):
    path = tiny_model(
        "qwen3_omni_moe", thinker_hidden_size=96, thinker_config={"text_config": {"num_hidden_layers": 3}},
        talker_num_hidden_layers=2, vision_depth=3, code2wav_codebook_size=32, code2wav_num_quantizers=3,
    )
    cfg = json.loads((path / "config.json").read_text())
    thinker, talker = cfg["thinker_config"], cfg["talker_config"]
    text = thinker["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"]) == (96, 3)
    # derived so the model still fits together: encoders' outputs, talker input, codec layout
    assert thinker["audio_config"]["output_dim"] == thinker["vision_config"]["out_hidden_size"] == 96
    assert talker["thinker_hidden_size"] == 96 and talker["text_config"]["num_hidden_layers"] == 2
    assert talker["num_code_groups"] == talker["code_predictor_config"]["num_code_groups"] == 3
    assert talker["code_predictor_config"]["vocab_size"] == 32
    assert talker["text_config"]["vocab_size"] == 32 + 1024 and talker["codec_eos_token_id"] == 34
    assert sum(text["rope_parameters"]["mrope_section"]) == 16 // 2
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()
    prepare_reference(model)
    tok = AutoTokenizer.from_pretrained(path)
    _, wav = generate(model, tok, chat_ids(tok, "Hi"), 4, 6)
    assert wav.numel() > 0


def test_override_errors_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown qwen3_omni_moe override 'hidden_size'"):
        make_tiny_model("qwen3_omni_moe", tmp_path / "a", hidden_size=96)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['hiden_size'\]"):
        make_tiny_model("qwen3_omni_moe", tmp_path / "b", thinker_hiden_size=96)
    with pytest.raises(ValueError, match="code_predictor_config"):
        make_tiny_model("qwen3_omni_moe", tmp_path / "c", talker_config={"code_predictor_config": {"foo": 1}})
    path = make_tiny_model("qwen3_omni_moe", tmp_path / "d", dtype="bfloat16", enable_audio_output=False)
    from safetensors.torch import load_file

    weights = load_file(path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert {k.split(".")[0] for k in weights} == {"thinker"}
