"""Our Qwen2 / Qwen3 / Qwen3-MoE decoders against transformers on tiny random checkpoints."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from vllm_omni.model_executor.dtypes import canonical_dtype, torch_dtype  # noqa: E402
from vllm_omni.model_executor.model_loader import iterate_safetensors, load_model  # noqa: E402
from vllm_omni.model_executor.models.registry import resolve_model_class, supported_architectures  # noqa: E402

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.3,
    max_position_embeddings=256,
)
ARCH_KWARGS = {
    "Qwen2ForCausalLM": dict(model_type="qwen2"),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=16),
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
}
NUM_LAYERS = COMMON["num_hidden_layers"]


def make_checkpoint(arch: str, out_dir, tied: bool, seed: int = 0, **overrides):
    kwargs = {**COMMON, **ARCH_KWARGS[arch], "tie_word_embeddings": tied, **overrides}
    config = AutoConfig.for_model(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return model


def hf_reference(model, input_ids: torch.Tensor):
    with torch.no_grad():
        out = model(input_ids[None], output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def run_ours(model, input_ids: torch.Tensor, capture=(0, 1, NUM_LAYERS)):
    positions = torch.arange(input_ids.numel())
    with torch.no_grad():
        hidden, captured = model(input_ids, positions, capture_layers=capture)
        return model.compute_logits(hidden), hidden, captured


CASES = [(arch, tied) for arch in ARCH_KWARGS for tied in (False, True)]


@pytest.mark.parametrize("arch,tied", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_matches_transformers(arch, tied, tmp_path):
    # Odd cases turn MoE renormalization off and make layer 1 dense, covering both paths.
    overrides = {"norm_topk_prob": False, "mlp_only_layers": [1]} if arch.startswith("Qwen3Moe") and tied else {}
    ref = make_checkpoint(arch, tmp_path, tied, **overrides)
    config = AutoConfig.from_pretrained(tmp_path)
    ours = load_model(tmp_path, config, dtype="auto", device="cpu")
    assert type(ours).__name__ == arch
    assert (ours.num_layers, ours.num_kv_heads, ours.hidden_size, ours.vocab_size) == (NUM_LAYERS, 2, 64, 512)
    assert ours.head_dim == 16

    input_ids = torch.randint(0, COMMON["vocab_size"], (21,), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_hidden = hf_reference(ref, input_ids)
    logits, final, captured = run_ours(ours, input_ids)

    assert logits.dtype == torch.float32 and logits.shape == (21, 512)
    torch.testing.assert_close(logits, ref_logits.float(), atol=1e-4, rtol=0)
    assert sorted(captured) == [0, 1, NUM_LAYERS]
    for idx in captured:
        torch.testing.assert_close(captured[idx], ref_hidden[idx], atol=1e-4, rtol=0, msg=f"hidden state {idx}")
    # transformers' last hidden state is the post-norm output, which is what ours returns.
    torch.testing.assert_close(final, ref_hidden[NUM_LAYERS], atol=1e-4, rtol=0)
    # Later stages feed embeddings instead of ids.
    embeds = ours.get_input_embeddings(input_ids)
    with torch.no_grad():
        from_embeds, _ = ours(None, torch.arange(21), inputs_embeds=embeds)
    torch.testing.assert_close(from_embeds, final, atol=0, rtol=0)


def test_all_layer_captures_match(tmp_path):
    ref = make_checkpoint("Qwen3ForCausalLM", tmp_path, tied=False, num_hidden_layers=3)
    ours = load_model(tmp_path, AutoConfig.from_pretrained(tmp_path), "float32", "cpu")
    input_ids = torch.arange(5, 25)
    _, ref_hidden = hf_reference(ref, input_ids)
    _, _, captured = run_ours(ours, input_ids, capture=range(4))
    assert len(ref_hidden) == 4
    for idx in range(4):
        torch.testing.assert_close(captured[idx], ref_hidden[idx], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        run_ours(ours, input_ids, capture=[4])


def test_sharded_checkpoint(tmp_path):
    ref = make_checkpoint("Qwen3MoeForCausalLM", tmp_path / "single", tied=False)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    config = AutoConfig.from_pretrained(tmp_path / "single")
    single = load_model(tmp_path / "single", config, "float32", "cpu")
    sharded = load_model(tmp_path / "sharded", config, "float32", "cpu")
    names = {name for name, _ in iterate_safetensors(tmp_path / "sharded")}
    assert names == {name for name, _ in iterate_safetensors(tmp_path / "single")}
    input_ids = torch.arange(3, 23)
    torch.testing.assert_close(run_ours(sharded, input_ids)[0], run_ours(single, input_ids)[0], atol=0, rtol=0)


@pytest.mark.parametrize("arch", list(ARCH_KWARGS))
def test_bfloat16_load_runs(arch, tmp_path):
    ref = make_checkpoint(arch, tmp_path, tied=False)
    config = AutoConfig.from_pretrained(tmp_path)
    ours = load_model(tmp_path, config, dtype="bfloat16", device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours.model.rotary_emb.cos_cache.dtype == torch.float32  # cast per use, like HF
    assert torch.get_default_dtype() == torch.float32  # construction restored the default
    input_ids = torch.arange(1, 21)
    logits, _, captured = run_ours(ours, input_ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert captured[NUM_LAYERS].dtype == torch.bfloat16
    # Against transformers in bf16 (bit-identical on CPU today; allow one bf16 ulp at |logit| ~ 10).
    ref_bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ref_logits, ref_hidden = hf_reference(ref_bf16, input_ids)
    torch.testing.assert_close(logits, ref_logits.float(), atol=0.07, rtol=0)
    torch.testing.assert_close(captured[1], ref_hidden[1], atol=0.07, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", list(ARCH_KWARGS))
def test_cuda_bfloat16_matches_transformers(arch, tmp_path):
    make_checkpoint(arch, tmp_path, tied=True)
    config = AutoConfig.from_pretrained(tmp_path)
    ours = load_model(tmp_path, config, dtype="bfloat16", device="cuda")
    assert all(p.device.type == "cuda" for p in ours.parameters())
    input_ids = torch.arange(1, 21, device="cuda")
    # The truth is transformers in float32; transformers in bf16 shows how far bf16 alone
    # drifts on this (deliberately chaotic) random model.
    truth_logits, truth_hidden = hf_reference(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval(), input_ids)
    ref_logits, ref_hidden = hf_reference(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval(), input_ids)
    with torch.no_grad():
        hidden, captured = ours(input_ids, torch.arange(20, device="cuda"), capture_layers=(0, 1, NUM_LAYERS))
        logits = ours.compute_logits(hidden)

    def rel_err(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # Our fused CUDA kernels round in a different order than torch, so we are not bit-equal to
    # transformers' bf16; we must be as close to the float32 truth as it is (within 2x + 1e-3).
    assert rel_err(logits, truth_logits) <= 2 * rel_err(ref_logits, truth_logits) + 1e-3
    def agreement(a):
        return (a.argmax(-1) == truth_logits.argmax(-1)).float().mean().item()

    assert agreement(logits) >= agreement(ref_logits) - 0.1
    for idx in captured:
        bound = 2 * rel_err(ref_hidden[idx], truth_hidden[idx]) + 1e-3
        assert rel_err(captured[idx], truth_hidden[idx]) <= bound, idx


def test_one_dtype_vocabulary():
    config = transformers.Qwen2Config()
    assert torch_dtype("auto", config) == torch.float32  # no dtype in the config
    config.dtype = "bfloat16"
    assert torch_dtype("auto", config) == torch.bfloat16
    assert torch_dtype("half", config) == torch.float16
    assert torch_dtype("float", config) == torch.float32
    assert torch_dtype(torch.float16) == torch.float16
    assert [canonical_dtype(s) for s in ("fp32", "bf16", "fp16", "torch.bfloat16")] == \
        ["float32", "bfloat16", "float16", "bfloat16"]
    with pytest.raises(ValueError, match="int8"):
        torch_dtype("int8", config)


def test_registry():
    assert set(supported_architectures()) >= {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
    assert resolve_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert resolve_model_class("Qwen2ForCausalLM", model_stage="thinker").__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        resolve_model_class("LlamaForCausalLM")


def test_missing_checkpoint_names_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        list(iterate_safetensors(tmp_path))


def test_strict_loading(tmp_path):
    make_checkpoint("Qwen2ForCausalLM", tmp_path, tied=False)
    config = AutoConfig.from_pretrained(tmp_path)
    model = resolve_model_class("Qwen2ForCausalLM")(config)
    weights = list(iterate_safetensors(tmp_path))
    loaded = model.load_weights(weights)
    assert "model.layers.0.self_attn.qkv_proj.bias" in loaded and "lm_head.weight" in loaded
    with pytest.raises(ValueError, match="no destination"):
        model.load_weights(weights + [("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    without_k = [(n, t) for n, t in weights if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj\.weight \(shards \['k'\]\)"):
        model.load_weights(without_k)
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights([(n, t[:-1] if n == "model.norm.weight" else t) for n, t in weights])
