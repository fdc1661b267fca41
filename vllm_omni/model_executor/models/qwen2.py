"""Qwen2 / Qwen2.5 causal LM (HF `Qwen2ForCausalLM`): q/k/v projections carry a bias."""
from __future__ import annotations

from transformers import PretrainedConfig

from vllm_omni.model_executor.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
)


def make_qwen2_layer(config: PretrainedConfig, layer_idx: int) -> DecoderLayer:
    attn = DecoderAttention(config, qkv_bias=True, o_bias=False, qk_norm=False)
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return DecoderLayer(config, attn, mlp)


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, DecoderModel(config, lambda i: make_qwen2_layer(config, i)))
