"""KV cache sizing from gpu_memory_utilization: a stage stays inside its fraction of the
device, uses most of it, and a fraction too small for one request is a clear error."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni import LLM  # noqa: E402

# KV of ~8 KB per token: a 0.05 fraction (~7 GB on an H200) is not capped by max_num_seqs.
MEDIUM = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64)


def test_engine_stays_within_its_memory_fraction(tiny_model):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_model("qwen3", **MEDIUM)), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    used = torch.cuda.memory_allocated() - before
    assert used <= 0.05 * total
    assert used >= 0.03 * total  # the KV cache takes what weights and activations leave
    assert llm.engine.block_manager.num_blocks > 1000
    del llm
    torch.cuda.empty_cache()


def test_fraction_too_small_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.001.*max-length request"):
        LLM(str(tiny_model("qwen3")), device="cuda", gpu_memory_utilization=0.001, max_model_len=4096)
