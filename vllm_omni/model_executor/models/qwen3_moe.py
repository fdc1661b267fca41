"""Qwen3-MoE causal LM (HF `Qwen3MoeForCausalLM`): Qwen3 attention, sparse MoE MLPs.

Layer i is sparse when it is not in `mlp_only_layers`, `num_experts > 0` and
`(i + 1) % decoder_sparse_step == 0` (HF's rule); other layers use a dense MLP of
`intermediate_size`.
"""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.layers.moe import SparseMoeBlock
from vllm_omni.model_executor.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel, GatedMLP
from vllm_omni.model_executor.models.qwen3 import make_qwen3_attention


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (
        layer_idx not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


def make_qwen3_moe_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    if is_sparse_layer(config, layer_idx):
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.hidden_act,
        )
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


def make_qwen3_moe_layer(config: PretrainedConfig, layer_idx: int) -> DecoderLayer:
    return DecoderLayer(config, make_qwen3_attention(config), make_qwen3_moe_mlp(config, layer_idx))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, DecoderModel(config, lambda i: make_qwen3_moe_layer(config, i)))
