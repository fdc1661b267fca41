"""Generic pre-norm decoder-only transformer shared by the Qwen family.

Architectures differ only in the attention flavour (qkv bias, per-head q/k norm) and in
the MLP of each layer (dense or sparse MoE); each architecture file builds its layers
from these parts and subclasses `DecoderForCausalLM`.

Inputs are packed: T tokens of possibly several sequences, with no batch dimension.
Sequence boundaries live in the forward context that `Attention` reads.

The residual stream is carried as (hidden, residual) and the add is fused into the next
RMSNorm (vLLM style); `x + residual` is the same float op as HF's
`residual + hidden_states`, so the stream stays bit-identical to transformers.

Built inside `parallel_state.building_with(group)`, the stack is tensor-parallel (Megatron
layout): vocabulary-sharded embedding and LM head, attention heads and the MLP's intermediate
dimension split over the ranks, one all-reduce after attention and one after the MLP; the
residual stream, norms and rotary are replicated. `num_heads` / `num_kv_heads` of an attention
module are the rank's own.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.layers.activation import get_gated_act
from vllm_omni.model_executor.layers.attention import Attention
from vllm_omni.model_executor.layers.layernorm import RMSNorm
from vllm_omni.model_executor.layers.linear import MergedGateUpLinear, QKVLinear, RowParallelLinear, fuses_norm, linear
from vllm_omni.model_executor.layers.rotary import get_rope
from vllm_omni.model_executor.layers.moe import map_expert_weight_name
from vllm_omni.model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from vllm_omni.model_executor.models.stage_model import StageModel
from vllm_omni.model_executor.models.utils import load_weights_strict, map_stacked_name


def config_head_dim(config: PretrainedConfig) -> int:
    # Qwen3 configs state head_dim; Qwen2 configs derive it (HF does the same fallback).
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_full_attention(config: PretrainedConfig) -> None:
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"{config.model_type}: use_sliding_window=True (sliding-window attention) is not supported"
        )


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.head_dim = config_head_dim(config)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        # Qwen3: RMSNorm over each head's vector, before rotary.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos/sin: [T, head_dim] -> [T, hidden]."""
        return self.attend(*self.qkv_proj(x), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """The rest of `forward` from the q/k/v product's output."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, rotary=(cos, sin))
        return self.o_proj(out)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.gate_up_proj = MergedGateUpLinear(hidden_size, intermediate_size)
        self.act_fn = get_gated_act(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the layer's true output is their sum.

        At a few decode rows on CUDA each norm runs inside the product after it (the q/k/v
        product; the MLP's gate/up product with its gated SiLU) where `fuses_norm` says that is
        faster: an attention that can `attend` from the q/k/v product's output, a `GatedMLP`."""
        attn, mlp = self.self_attn, self.mlp
        if hasattr(attn, "attend") and fuses_norm(hidden, self.input_layernorm.weight, attn.qkv_proj.weight):
            qkv, residual = self.input_layernorm.then_linear(hidden, residual, attn.qkv_proj.weight,
                                                             attn.qkv_proj.bias)
            hidden = attn.attend(*attn.qkv_proj.split(qkv), cos, sin)
        else:
            if residual is None:
                residual, hidden = hidden, self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = attn(hidden, cos, sin)
        norm = self.post_attention_layernorm
        if isinstance(mlp, GatedMLP) and fuses_norm(hidden, norm.weight, mlp.gate_up_proj.weight):
            act, residual = norm.then_linear(hidden, residual, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                             gated=True)
            return mlp.down_proj(act), residual
        hidden, residual = norm(hidden, residual)
        return mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` submodule)."""

    def __init__(self, config: PretrainedConfig, make_layer: Callable[[int], DecoderLayer]):
        super().__init__()
        check_full_attention(config)
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(self.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = get_rope(config_head_dim(config), config.rope_parameters, config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        capture_layers: Collection[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Capture indices follow HF's `output_hidden_states`: 0 = input embeddings,
        i in [1, L) = output of layer i-1, L = final post-norm output (HF overwrites
        its last entry with `last_hidden_state`)."""
        bad = [i for i in capture_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} out of range [0, {self.num_layers}]")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        captured: dict[int, torch.Tensor] = {}
        if 0 in capture_layers:
            captured[0] = hidden
        # Computed once per step; every layer shares the same positions.
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            if i > 0 and i in capture_layers:
                captured[i] = hidden + residual
            hidden, residual = layer(hidden, residual, cos, sin)
        hidden, _ = self.norm(hidden, residual)
        if self.num_layers in capture_layers:
            captured[self.num_layers] = hidden
        return hidden, captured


class DecoderForCausalLM(StageModel):
    """A decoder LM as the AR engine drives it (a plain LLM: no hook overridden); subclasses
    build `self.model`."""

    def __init__(self, config: PretrainedConfig, model: DecoderModel):
        super().__init__()
        self.config = config
        self.model = model
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config_head_dim(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # same Parameter, listed once by named_parameters
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        inputs_embeds: torch.Tensor | None = None,
        capture_layers: Collection[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        return self.model(input_ids, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[B, V] float32 logits; with tensor parallelism on rank 0 only (the others get None)."""
        # Matmul in the model dtype like HF's lm_head, then float32 for sampling.
        logits = self.lm_head.gather_logits(linear(hidden_states, self.lm_head.weight))
        return None if logits is None else logits.float()

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None  # HF ignores a stored lm_head when embeddings are tied; so do we
        if "rotary_emb.inv_freq" in name:
            return None  # derived buffer that some old checkpoints saved
        return map_expert_weight_name(name) or map_stacked_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_strict(self, weights, self.map_weight_name)
