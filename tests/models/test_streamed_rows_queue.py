"""StreamedRowsQueue: a talker's streamed input rows wait on the host and join their requests'
rows at the next step, every request's in one upload and one transform call."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_omni.core.request import RequestStatus
from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.model_executor.models.bridge_utils import StreamedRowsQueue


def request() -> SimpleNamespace:
    return SimpleNamespace(status=RequestStatus.RUNNING)


def test_rows_join_their_requests_in_order_through_one_transform():
    queue, like = StreamedRowsQueue(), torch.zeros(1, 2, dtype=torch.float64)
    a, b = request(), request()
    sink_a, sink_b = GrowingTensor(torch.zeros(1, 2, dtype=torch.float64)), GrowingTensor(torch.zeros(0, 2, dtype=torch.float64))
    rows = [torch.full((n, 2), float(i), dtype=torch.float32) for i, n in enumerate((1, 2, 1), start=1)]
    queue.put(a, sink_a, (rows[0], rows[0]))
    queue.put(b, sink_b, (rows[1], rows[1]))
    end = torch.full((2, 2), -1.0, dtype=torch.float64)
    queue.put_ready(a, sink_a, end)  # after a's queued row
    queue.put(a, sink_a, (rows[2], rows[2]))  # after the ready rows
    assert (queue.num_rows(a), queue.num_rows(b), len(sink_a)) == (4, 2, 1)
    calls = []

    def add(x, y):
        calls.append((x.shape[0], x.dtype))
        return x + y

    queue.flush(like, add)
    assert calls == [(4, torch.float64)]  # every request's rows, on like's dtype, in one call
    assert sink_a.view[:, 0].tolist() == [0.0, 2.0, -1.0, -1.0, 6.0]
    assert sink_b.view[:, 0].tolist() == [4.0, 4.0]
    assert queue.num_rows(a) == 0
    queue.flush(like, add)
    assert len(calls) == 1  # nothing queued: no call


def test_ready_rows_go_straight_in_when_nothing_waits():
    queue, sink = StreamedRowsQueue(), GrowingTensor(torch.zeros(1, 2))
    queue.put_ready(request(), sink, torch.ones(1, 2))
    assert sink.view.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_a_finished_request_is_dropped():
    queue, sink, gone = StreamedRowsQueue(), GrowingTensor(torch.zeros(0, 2)), request()
    queue.put(gone, sink, (torch.ones(1, 2),))
    gone.status = RequestStatus.FINISHED_ABORTED
    calls = []
    queue.flush(torch.zeros(1, 2), lambda x: calls.append(x) or x)
    assert (calls, len(sink), queue.num_rows(gone)) == ([], 0, 0)
