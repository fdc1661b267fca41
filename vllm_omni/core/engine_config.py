"""Engine arguments, validated once (DESIGN section 6)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import vllm_omni.envs as envs
from vllm_omni.model_executor.dtypes import DTYPE_SPELLINGS


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to `model`
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped by the KV pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # False: each prompt is prefilled in one step (vLLM's flag)
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # explicit KV pool size; overrides the memory-based sizing
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; CPU default is 256 MiB
    enforce_eager: bool = False
    # Hidden states exported per request (transformers' output_hidden_states indices);
    # "last" (the final post-norm states) is always exported when a request asks for hidden states.
    hidden_state_layers: tuple[int, ...] = ()
    architecture: str | None = None  # override config.architectures[0] (spec 000 `model_arch`)
    model_stage: str | None = None  # which stage model of a multi-stage checkpoint (thinker, talker, ...)
    load_format: str = "auto"  # "dummy": random weights of the real shapes (benchmarks)
    # Threads reading the checkpoint ahead of the loader (model_loader.iterate_safetensors).
    num_weight_load_threads: int = 1
    # A talker's code predictor sampling (the stage's subtalker_sampling_params); empty: the model's.
    predictor_sampling: tuple[tuple[str, Any], ...] = ()
    # Ranks that split the model (one process each, rank 0 in this one; core/tp_executor.py).
    tensor_parallel_size: int = 1
    # vLLM's async scheduling: the next step is scheduled and launched before the host reads the
    # tokens of the step in flight (outputs come one step later); off under tensor parallelism.
    # VLLM_OMNI_ASYNC_SCHEDULING=0 turns it off in every engine of the process and its children.
    async_scheduling: bool = field(default_factory=envs.ASYNC_SCHEDULING.get)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"engine argument {name}={getattr(self, name)!r} is invalid: must be {allowed}")

        if self.dtype not in DTYPE_SPELLINGS:
            raise bad("dtype", f"one of {list(DTYPE_SPELLINGS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", ">= 1 or None")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", ">= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", "a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.load_format not in ("auto", "dummy"):
            raise bad("load_format", "'auto' or 'dummy'")
        if self.num_weight_load_threads < 1:
            raise bad("num_weight_load_threads", ">= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", ">= 1 or None")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", ">= 1")
