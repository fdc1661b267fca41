"""How many KV blocks a stage gets, and the resulting max_model_len."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.engine.engine_config import EngineConfig
from vllm_omni.worker.model_runner import ARModelRunner

CPU_DEFAULT_KV_BYTES = 256 * 2**20
# Kept free on a GPU for activations of the largest step until issue 6 profiles them.
GPU_ACTIVATION_HEADROOM_BYTES = 2 * 2**30


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    max_model_len: int


def _kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    used = torch.cuda.memory_allocated(device)
    return int(total * config.gpu_memory_utilization) - used - GPU_ACTIVATION_HEADROOM_BYTES


def plan_kv_cache(
    config: EngineConfig, model: nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device
) -> KVCachePlan:
    bs = config.block_size
    # A stage model of a multi-stage checkpoint knows its own limit; the top-level config may not.
    model_limit = (
        getattr(model, "max_position_embeddings", None) or getattr(hf_config, "max_position_embeddings", None) or 4096
    )
    wanted_len = config.max_model_len or model_limit
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        per_block = ARModelRunner.kv_bytes_per_block(model, bs, dtype)
        budget = _kv_budget_bytes(config, device)
        num_blocks = max(budget // per_block, 0)
        # No point holding more than every sequence at full length.
        num_blocks = min(num_blocks, config.max_num_seqs * -(-wanted_len // bs))
    capacity = num_blocks * bs
    if config.max_model_len is None:
        max_model_len = min(model_limit, capacity)
    else:
        max_model_len = config.max_model_len
        if max_model_len > capacity:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {bs}), fewer than one request of "
                f"max_model_len={max_model_len}: raise gpu_memory_utilization / num_kv_blocks or lower max_model_len"
            )
    if max_model_len < 2:
        raise ValueError(
            f"the KV cache budget leaves room for {capacity} tokens: not enough for any request "
            "(raise gpu_memory_utilization, num_kv_blocks or kv_cache_memory_bytes)"
        )
    return KVCachePlan(num_blocks=num_blocks, max_model_len=max_model_len)
