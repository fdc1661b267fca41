"""Qwen3 dense causal LM (HF `Qwen3ForCausalLM`).

Differs from Qwen2 by per-head RMSNorm on q and k before rotary, an explicit
`head_dim` (not hidden/heads) and `attention_bias` (False in released models) on all
four projections.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from vllm_omni.model_executor.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
)


def make_qwen3_attention(config: PretrainedConfig) -> DecoderAttention:
    bias = bool(config.attention_bias)
    return DecoderAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=True)


def make_qwen3_layer(config: PretrainedConfig, layer_idx: int) -> DecoderLayer:
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return DecoderLayer(config, make_qwen3_attention(config), mlp)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, DecoderModel(config, lambda i: make_qwen3_layer(config, i)))
