"""A talker takes the thinker's rows a chunk per request per thinker step, between its own
steps: moving a chunk to the GPU must not wait for the talker's queued work."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.model_executor.models.bridge_utils import rows_like  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_move_to_the_gpu_without_waiting(dtype):
    weight = torch.zeros(4, 2048, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(3, 2048, dtype=dtype)
    rows_like(rows, weight)  # warm-up: the pinned staging memory
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue GPU work that a waiting copy would have to sit out
        busy = busy @ busy
        busy /= busy.norm()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = rows_like(rows, weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.device == weight.device and moved.dtype == weight.dtype
    torch.testing.assert_close(moved.cpu(), rows.to(torch.bfloat16))
