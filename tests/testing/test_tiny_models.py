import json
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_omni.testing.tiny_models import demo_model_path, make_tiny_model, tiny_checkpoint_builders
from vllm_omni.testing.tokenizer import QWEN3_OMNI_MM_TOKENS, SPECIAL_TOKENS, make_tiny_tokenizer

ARCHS = ["qwen2", "qwen3", "qwen3_moe"]


def _weights(path):
    return load_file(path / "model.safetensors")


def test_caller_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model("qwen2", tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_back_and_generates_diverse_tokens(tiny_model, arch):
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    # Random models must not collapse into one repeated token, or output comparisons prove little.
    for prompt in ["Hello", "What is the capital of France?", "Once upon a time"]:
        inputs = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False, eos_token_id=None)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(new) == 30 and len(set(new)) >= 5, new
        assert len(set(new[15:])) >= 3, new


def test_config_defaults_and_overrides(tiny_model):
    tok = make_tiny_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for arch, tied in [("qwen2", False), ("qwen3", True), ("qwen3_moe", False)]:
        path = tiny_model(arch)
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is tied
        assert cfg["dtype"] == "float32" and cfg["eos_token_id"] == im_end
        assert ("lm_head.weight" in _weights(path)) is not tied
        gen = json.loads((path / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [im_end, tok.pad_token_id]
        assert gen["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
        assert gen.get("bos_token_id") is None

    path = tiny_model("qwen3", num_hidden_layers=3, tie_word_embeddings=False, dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["dtype"] == "bfloat16"
    weights = _weights(path)
    assert "model.layers.2.mlp.up_proj.weight" in weights and "lm_head.weight" in weights
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_moe_checkpoint_uses_hub_layout(tiny_model):
    weights = _weights(tiny_model("qwen3_moe"))
    for i in range(4):
        assert weights[f"model.layers.1.mlp.experts.{i}.gate_proj.weight"].shape == (32, 64)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (4, 64)


def test_norms_and_biases_are_not_constant(tiny_model):
    # A loader that skips them must change the outputs.
    weights = _weights(tiny_model("qwen2"))
    for name in ["model.norm.weight", "model.layers.0.self_attn.q_proj.bias"]:
        assert weights[name].std() > 0.05, name


def test_tokenizer_round_trip_and_special_tokens():
    tok = make_tiny_tokenizer()
    assert len(tok) % 64 == 0  # no embedding row without a token
    for text in ["Hello, world!", "héllo wörld 你好 😀\n\ttabs  and  spaces", ""]:
        assert tok.decode(tok(text).input_ids) == text
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tok.unk_token_id not in ids
    assert tok("<|im_start|><|AUDIO|><tts_pad>").input_ids == ids[1:2] + ids[3:4] + ids[17:18]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    for word in ["system", "user", "assistant"]:  # Qwen3-Omni looks them up as single tokens
        assert tok.tokenize(word) == [word]
    assert tok.image_token == "<|IMAGE|>" and tok.audio_token_id == tok.convert_tokens_to_ids("<|AUDIO|>")
    assert make_tiny_tokenizer(QWEN3_OMNI_MM_TOKENS).image_token == "<|image_pad|>"


def test_chat_template(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe"):
        make_tiny_model("llama", tmp_path)
    assert not any(tmp_path.iterdir())


def test_demo_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_CACHE", str(tmp_path))
    path = demo_model_path("qwen3")
    assert path == tmp_path / "demo-qwen3-v2" and (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model_path("qwen3") == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen3-v2"]  # no temp dir left
    with pytest.raises(ValueError, match="no demo model for 'llama'"):
        demo_model_path("llama")


def test_default_demo_model_is_the_tiny_omni():
    import vllm_omni.testing.tiny_models as tm

    # What `vllm-omni generate` runs without a model (built in tests/e2e/test_cli_generate.py).
    assert tm.DEMO_ARCH == "qwen2_5_omni" and tm.DEMO_MODELS[tm.DEMO_ARCH] == ("qwen2_5_omni_demo",
                                                                            "demo-qwen2_5_omni-v3")


def test_cli(tmp_path, capsys):
    from vllm_omni.testing.__main__ import main

    out = tmp_path / "m"
    main(["qwen2", str(out), "--seed", "2", "--set", "num_hidden_layers=1", "--set", "dtype=bfloat16"])
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["dtype"] == "bfloat16"


def test_registry_has_the_three_archs():
    assert set(ARCHS) <= set(tiny_checkpoint_builders())


def test_demo_model_path_lost_race(tmp_path, monkeypatch):
    # Another process finishes first while we build: keep its copy, discard ours.
    import vllm_omni.testing.tiny_models as tm

    monkeypatch.setenv("VLLM_OMNI_CACHE", str(tmp_path))
    real_make = tm.make_tiny_model

    def make_and_lose(arch, out_dir, **kw):
        real_make(arch, tmp_path / "demo-qwen3-v2", **kw)
        return real_make(arch, out_dir, **kw)

    monkeypatch.setattr(tm, "make_tiny_model", make_and_lose)
    assert tm.demo_model_path("qwen3") == tmp_path / "demo-qwen3-v2"
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen3-v2"]
