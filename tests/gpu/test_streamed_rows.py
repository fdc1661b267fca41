"""A talker takes the thinker's rows a chunk per request per thinker step, between its own
steps, and moves every request's new rows to the GPU at its next step: neither may wait for
the talker's queued work."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.core.request import RequestStatus  # noqa: E402
from vllm_omni.growing_tensor import GrowingTensor  # noqa: E402
from vllm_omni.model_executor.models.bridge_utils import StreamedRowsQueue, rows_like  # noqa: E402


def queue_gpu_work() -> None:
    """Work that a waiting copy would have to sit out."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy
        busy /= busy.norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_move_to_the_gpu_without_waiting(dtype):
    weight = torch.zeros(4, 2048, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(3, 2048, dtype=dtype)
    rows_like(rows, weight)  # warm-up: the pinned staging memory
    queue_gpu_work()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = rows_like(rows, weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.device == weight.device and moved.dtype == weight.dtype
    torch.testing.assert_close(moved.cpu(), rows.to(torch.bfloat16))


class _Request:
    status = RequestStatus.RUNNING


def test_queued_rows_of_many_requests_flush_without_waiting():
    weight = torch.zeros(4, 2048, device="cuda", dtype=torch.bfloat16)
    requests = [_Request() for _ in range(3)]
    sinks = [GrowingTensor(weight[:0]) for _ in requests]
    queue = StreamedRowsQueue()

    def stream_a_step() -> list[torch.Tensor]:
        rows = [torch.randn(1, 2048) for _ in requests]
        for request, sink, row in zip(requests, sinks, rows):
            queue.put(request, sink, (row, row))
        queue.flush(weight, torch.add)
        return rows

    stream_a_step()  # warm-up: the pinned staging memory, the sinks' first buffers
    queue_gpu_work()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = stream_a_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for sink, row in zip(sinks, rows):
        assert torch.equal(sink.view[-1].cpu(), (row.to(torch.bfloat16) * 2)[0])
