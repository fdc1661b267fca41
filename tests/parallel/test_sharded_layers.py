"""Each sharded layer against the same layer unsharded: 2 gloo ranks (threads), float32.

Every rank loads its shard from the same full "checkpoint" tensors, through the parameter
loaders the model loader uses; the ranks' outputs must equal the matching slices of the
unsharded layer's output (column-parallel layers) or all of it (after an all-reduce).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from tests.parallel.conftest import run_ranks
from vllm_omni.model_executor.layers.linear import MergedGateUpLinear, QKVLinear, RowParallelLinear
from vllm_omni.model_executor.layers.moe import SparseMoeBlock
from vllm_omni.model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from vllm_omni.model_executor.model_loader import iterate_safetensors_slices
from vllm_omni.model_executor.models.decoder import DecoderAttention, GatedMLP
from vllm_omni.model_executor.models.utils import load_weights_strict
from vllm_omni.model_executor.parallel_state import building_with

H, D, T = 32, 8, 7  # hidden size, head dim, tokens


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build(group, make):
    with building_with(group):
        return make()


def load(layer: torch.nn.Module, checkpoint: dict[str, tuple[str, object, torch.Tensor]]) -> None:
    """checkpoint: name -> (parameter name, shard id, tensor), loaded through the strict loader."""
    mapping = {name: (param, shard) for name, (param, shard, _) in checkpoint.items()}
    load_weights_strict(layer, ((name, t) for name, (_, _, t) in checkpoint.items()), mapping.get)


def qkv_checkpoint(heads: int, kv_heads: int) -> dict:
    return {
        "q.w": ("weight", "q", rand(heads * D, H, seed=1)), "k.w": ("weight", "k", rand(kv_heads * D, H, seed=2)),
        "v.w": ("weight", "v", rand(kv_heads * D, H, seed=3)), "q.b": ("bias", "q", rand(heads * D, seed=4)),
        "k.b": ("bias", "k", rand(kv_heads * D, seed=5)), "v.b": ("bias", "v", rand(kv_heads * D, seed=6)),
    }


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)], ids=["kv_sharded", "kv_replicated"])
def test_qkv_shards_heads(heads, kv_heads):
    ckpt, x = qkv_checkpoint(heads, kv_heads), rand(T, H, seed=0)
    full = QKVLinear(H, D, heads, kv_heads, bias=True)
    load(full, ckpt)
    q, k, v = (t.view(T, -1, D) for t in full(x))

    def rank(group):
        layer = build(group, lambda: QKVLinear(H, D, heads, kv_heads, bias=True))
        load(layer, ckpt)
        return layer.num_heads, layer.num_kv_heads, [t.view(T, -1, D) for t in layer(x)]

    for r, (n, n_kv, (qr, kr, vr)) in enumerate(run_ranks(2, rank)):
        assert (n, n_kv) == (heads // 2, max(1, kv_heads // 2))
        # Same dot products, but a smaller matrix may be blocked differently by the BLAS: float32 noise.
        torch.testing.assert_close(qr, q[:, r * n : (r + 1) * n])
        kv = slice(r * kv_heads // 2, r * kv_heads // 2 + n_kv)  # the KV head this rank's queries share
        torch.testing.assert_close(kr, k[:, kv])
        torch.testing.assert_close(vr, v[:, kv])


def test_gate_up_shards_both_halves():
    ckpt = {"g": ("weight", 0, rand(24, H, seed=1)), "u": ("weight", 1, rand(24, H, seed=2))}
    x = rand(T, H, seed=0)
    full = MergedGateUpLinear(H, 24)
    load(full, ckpt)
    gate, up = full(x).chunk(2, dim=-1)

    def rank(group):
        layer = build(group, lambda: MergedGateUpLinear(H, 24))
        load(layer, ckpt)
        return layer(x)

    for r, out in enumerate(run_ranks(2, rank)):
        torch.testing.assert_close(out, torch.cat([gate[:, r * 12 : (r + 1) * 12], up[:, r * 12 : (r + 1) * 12]], -1))


def test_row_parallel_sums_partial_products_and_adds_bias_once():
    ckpt = {"w": ("weight", None, rand(H, 24, seed=1)), "b": ("bias", None, rand(H, seed=2))}
    x = rand(T, 24, seed=0)
    full = RowParallelLinear(24, H, bias=True)
    load(full, ckpt)
    expected = full(x)

    def rank(group):
        layer = build(group, lambda: RowParallelLinear(24, H, bias=True))
        load(layer, ckpt)
        assert layer.weight.shape == (H, 12)
        return layer(x[:, group.rank * 12 : (group.rank + 1) * 12])  # the column-parallel slice it consumes

    for out in run_ranks(2, rank):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gated_mlp_and_qwen3_attention_equal_unsharded():
    config = Qwen3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                         intermediate_size=48, rms_norm_eps=1e-6, attention_bias=True)
    x, cos, sin = rand(T, H, seed=0), rand(T, D, seed=10).cos(), rand(T, D, seed=11).sin()
    ckpt = {f"self_attn.{p}": (f"attn.{p}", None, rand(*shape, seed=20 + i)) for i, (p, shape) in enumerate(
        [("o_proj.weight", (H, 4 * D)), ("o_proj.bias", (H,)), ("q_norm.weight", (D,)), ("k_norm.weight", (D,))])}
    ckpt |= {f"self_attn.{k}": (f"attn.qkv_proj.{p}", s, t) for k, (p, s, t) in qkv_checkpoint(4, 2).items()}
    ckpt |= {"mlp.gate": ("mlp.gate_up_proj.weight", 0, rand(48, H, seed=30)),
             "mlp.up": ("mlp.gate_up_proj.weight", 1, rand(48, H, seed=31)),
             "mlp.down": ("mlp.down_proj.weight", None, rand(H, 48, seed=32))}

    def make():
        block = torch.nn.Module()
        block.attn = DecoderAttention(config, qkv_bias=True, o_bias=True, qk_norm=True)
        block.mlp = GatedMLP(H, 48, "silu")
        return block

    def run(block):
        return block.attn(x, cos, sin), block.mlp(x)

    full = make()
    load(full, ckpt)
    expected = run(full)

    def rank(group):
        block = build(group, make)
        load(block, ckpt)
        return run(block)

    for attn, mlp in run_ranks(2, rank):
        torch.testing.assert_close(attn, expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp, expected[1], rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_and_lm_head_with_padding():
    vocab = 11  # 6 rows per rank: rank 1 holds 5 and one zero padding row
    table, head = rand(vocab, H, seed=1), rand(vocab, H, seed=2)
    ids, hidden = torch.tensor([0, 5, 6, 10, 3]), rand(3, H, seed=3)
    expected_embeds = torch.nn.functional.embedding(ids, table)
    expected_logits = hidden @ head.T

    def rank(group):
        embed = build(group, lambda: VocabParallelEmbedding(vocab, H))
        lm_head = build(group, lambda: ParallelLMHead(vocab, H))
        load(embed, {"e": ("weight", None, table)})
        load(lm_head, {"h": ("weight", None, head)})
        logits = lm_head.gather_logits(torch.nn.functional.linear(hidden, lm_head.weight))
        return embed.weight.shape, embed(ids), logits

    (shape0, embeds0, logits0), (shape1, embeds1, logits1) = run_ranks(2, rank)
    assert shape0 == shape1 == (6, H)
    torch.testing.assert_close(embeds0, expected_embeds, rtol=0, atol=0)  # one non-zero row per token: exact
    torch.testing.assert_close(embeds1, expected_embeds, rtol=0, atol=0)
    torch.testing.assert_close(logits0, expected_logits, rtol=1e-5, atol=1e-5)
    assert logits1 is None  # only rank 0 samples


def test_moe_shards_every_experts_intermediate_dimension():
    experts, inter = 4, 16
    ckpt = {"gate": ("gate.weight", None, rand(experts, H, seed=1))}
    for e in range(experts):
        ckpt[f"{e}.g"] = ("experts.w13_weight", (e, 0), rand(inter, H, seed=10 + e))
        ckpt[f"{e}.u"] = ("experts.w13_weight", (e, 1), rand(inter, H, seed=20 + e))
        ckpt[f"{e}.d"] = ("experts.w2_weight", (e, None), rand(H, inter, seed=30 + e))
    x = rand(T, H, seed=0)
    full = SparseMoeBlock(H, inter, experts, 2, True)
    load(full, ckpt)
    expected = full(x)

    def rank(group):
        block = build(group, lambda: SparseMoeBlock(H, inter, experts, 2, True))
        load(block, ckpt)
        assert block.experts.w13_weight.shape == (experts, inter, H)  # [gate | up], 8 rows each
        assert block.experts.w2_weight.shape == (experts, H, inter // 2)
        return block(x)

    for out in run_ranks(2, rank):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_ranks_read_only_their_shard_from_safetensors(tmp_path, monkeypatch):
    tensors = {"w": rand(H, 24, seed=1), "b": rand(H, seed=2)}
    save_file(tensors, tmp_path / "model.safetensors")
    reads = []
    from vllm_omni.model_executor import checkpoint_slice

    narrow, load_whole = checkpoint_slice.CheckpointSlice.narrow, checkpoint_slice.CheckpointSlice.load
    monkeypatch.setattr(checkpoint_slice.CheckpointSlice, "narrow",
                        lambda self, *a: reads.append(("part", self._name, a)) or narrow(self, *a))
    monkeypatch.setattr(checkpoint_slice.CheckpointSlice, "load",
                        lambda self: reads.append(("whole", self._name)) or load_whole(self))

    def rank(group):
        layer = build(group, lambda: RowParallelLinear(24, H, bias=True))
        names = {"w": ("weight", None), "b": ("bias", None)}
        load_weights_strict(layer, iterate_safetensors_slices(tmp_path), names.get)
        return layer.weight.clone(), layer.bias.clone()

    for r, (weight, bias) in enumerate(run_ranks(2, rank)):
        torch.testing.assert_close(weight, tensors["w"][:, r * 12 : (r + 1) * 12], rtol=0, atol=0)
        torch.testing.assert_close(bias, tensors["b"], rtol=0, atol=0)
    # The sharded weight is read in halves along its input dimension; the replicated bias whole.
    assert sorted(reads) == [("part", "w", (1, 0, 12)), ("part", "w", (1, 12, 12)), ("whole", "b"), ("whole", "b")]


def test_shapes_that_do_not_divide_are_clear_errors():
    def rank(group):
        with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=3"):
            build(group, lambda: QKVLinear(H, D, 3, 1, bias=False))
        with pytest.raises(ValueError, match="num_key_value_heads=3"):
            build(group, lambda: QKVLinear(H, D, 6, 3, bias=False))
        with pytest.raises(ValueError, match="moe_intermediate_size=15"):
            build(group, lambda: SparseMoeBlock(H, 15, 4, 2, True))

    run_ranks(2, rank)


def test_dummy_weights_are_the_same_model_at_every_tp_size(tiny_model):
    """load_format "dummy" (benchmarks on real architectures without weights): each rank's shard
    is the matching part of the single-rank tensors, so TP=2 computes the TP=1 model's logits."""
    from transformers import AutoConfig

    from vllm_omni.model_executor.model_loader import load_model

    path = tiny_model("qwen3_moe")
    config = AutoConfig.from_pretrained(path)
    ids, positions = torch.tensor([5, 17, 300, 42, 9]), torch.arange(5)
    full = load_model(path, config, "float32", load_format="dummy")
    with torch.no_grad():
        expected = full.compute_logits(full(ids, positions)[0])

    def rank(group):
        model = build(group, lambda: load_model(path, config, "float32", load_format="dummy"))
        with torch.no_grad():
            return model.compute_logits(model(ids, positions)[0])

    logits, none = run_ranks(2, rank)
    assert none is None
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-6)
    assert expected.std() > 1e-3  # not a degenerate all-zero model
