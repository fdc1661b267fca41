"""How many KV blocks a stage gets, and the resulting max_model_len.

On CUDA the stage owns `gpu_memory_utilization` x the device's memory: its weights, the
peak activations of the largest step (measured by a profiling forward pass), a reserve for
CUDA graphs and sampling, and the KV cache in what is left. Other stages on the same GPU
own their own fractions, so fractions that sum to <= 1 never compete.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.model_runner import ARModelRunner
from vllm_omni.model_executor.models.stage_model import StageModel

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 256 * 2**20
# CUDA graphs' private pool, sampler temporaries and allocator slack.
GPU_RESERVE_BYTES = 512 * 2**20
GIB = 2**30


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    max_model_len: int


@torch.inference_mode()
def profile_peak_activation_bytes(
    model: StageModel, config: EngineConfig, device: torch.device, max_position: int
) -> int:
    """Peak memory of a forward pass over max_num_batched_tokens tokens, above the weights."""
    num_tokens = config.max_num_batched_tokens
    positions = torch.arange(num_tokens, device=device) % max_position
    if model.uses_mrope:
        positions = positions.expand(3, num_tokens)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden, _ = model(ids, positions, capture_layers=config.hidden_state_layers)
    model.compute_logits(hidden[: config.max_num_seqs])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def _cuda_kv_budget(
    config: EngineConfig, model: StageModel, device: torch.device, one_request_bytes: int, max_position: int
) -> int:
    total = torch.cuda.get_device_properties(device).total_memory
    weights = torch.cuda.memory_allocated(device)
    activations = profile_peak_activation_bytes(model, config, device, max_position)
    stage_bytes = int(total * config.gpu_memory_utilization)
    budget = stage_bytes - weights - activations - GPU_RESERVE_BYTES
    logger.info(
        "GPU memory for this stage: %.2f GiB (%.2f x %.2f GiB): weights %.2f, activations %.2f, reserve %.2f, "
        "KV cache %.2f GiB", stage_bytes / GIB, config.gpu_memory_utilization, total / GIB, weights / GIB,
        activations / GIB, GPU_RESERVE_BYTES / GIB, max(budget, 0) / GIB,
    )
    if budget < one_request_bytes:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} gives this stage {stage_bytes / GIB:.2f} GiB of "
            f"{total / GIB:.2f} GiB, but weights ({weights / GIB:.2f} GiB) + peak activations "
            f"({activations / GIB:.2f} GiB) + reserve ({GPU_RESERVE_BYTES / GIB:.2f} GiB) + the KV cache of one "
            f"max-length request ({one_request_bytes / GIB:.2f} GiB) do not fit: raise gpu_memory_utilization or "
            "lower max_model_len / max_num_batched_tokens"
        )
    return budget


def plan_kv_cache(
    config: EngineConfig, model: StageModel, dtype: torch.dtype, device: torch.device
) -> KVCachePlan:
    bs = config.block_size
    # A stage model of a multi-stage checkpoint knows its own limit; the top-level config may not.
    model_limit = model.max_position_embeddings
    wanted_len = config.max_model_len or model_limit
    per_block = ARModelRunner.kv_bytes_per_block(model, bs, dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif device.type == "cuda":
            budget = _cuda_kv_budget(config, model, device, -(-wanted_len // bs) * per_block, model_limit)
        else:
            budget = CPU_DEFAULT_KV_BYTES
        # No point holding more than every sequence at full length.
        num_blocks = min(max(budget // per_block, 0), config.max_num_seqs * -(-wanted_len // bs))
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
