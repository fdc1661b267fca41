"""Message encoding: zero-copy frames, shared memory above the threshold, raw-byte dtypes."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
import zmq

from vllm_omni.engine.messages import StageOutputBatch, StatsRequest
from vllm_omni.stage_io import StageOutput, StageRequest
from vllm_omni.engine.transport import (
    LinkGuard, OrchestratorChannel, WorkerChannel, make_ipc_dir, stage_addresses, sweep_shared_memory,
)
from vllm_omni.sampling_params import SamplingParams

PREFIX = f"vomni-test-{os.getpid()}-"
ORCH, WORKER = f"{PREFIX}o-", f"{PREFIX}w-"  # each side names its segments; each accepts the other's


def orchestrator_channel(ctx, in_addr, out_addr):
    return OrchestratorChannel(ctx, in_addr, out_addr, 1024, ORCH, LinkGuard(accept_shm_prefix=WORKER))


def worker_channel(ctx, in_addr, out_addr):
    return WorkerChannel(ctx, in_addr, out_addr, 1024, WORKER, LinkGuard(accept_shm_prefix=ORCH))


def shm_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(PREFIX))


@pytest.fixture
def ipc_dir():
    path = make_ipc_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def channels(ipc_dir):
    ctx = zmq.Context()
    in_addr, out_addr = stage_addresses(ipc_dir, 0)
    orch = orchestrator_channel(ctx, in_addr, out_addr)
    worker = worker_channel(ctx, in_addr, out_addr)
    yield orch, worker
    orch.close()
    worker.close()
    ctx.term()
    sweep_shared_memory(PREFIX)


def test_tensors_round_trip_by_frame_and_by_shared_memory(channels):
    orch, worker = channels
    tensors = {
        "big_bf16": torch.randn(64, 64).to(torch.bfloat16),  # 8 KiB: shared memory
        "small": torch.arange(6, dtype=torch.int32).reshape(2, 3),  # a zero-copy frame
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(8, 8).t(),  # non-contiguous input
    }
    worker.send(StageOutputBatch(3, [StageOutput(request_id="a", finished=True, new_token_ids=[1, 2],
                                                 multimodal_output=tensors)]))
    msg = asyncio.run(orch.recv(5000))
    got = msg.outputs[0].multimodal_output
    assert msg.stage_id == 3 and msg.outputs[0].new_token_ids == [1, 2]
    for key, tensor in tensors.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert shm_segments() == []  # the receiver unlinked the segment


def test_requests_carry_sampling_params_and_nested_payloads(channels):
    orch, worker = channels
    embeds = torch.randn(300, 4)
    orch.send_nowait(StageRequest(request_id="r#0", prompt_token_ids=[1, 2], sampling_params=SamplingParams(
        temperature=0.5, max_tokens=7, stop_token_ids=[3]), additional_information={
            "prompt_embeds": embeds, "meta": [1, "x", {"codes": torch.ones(2, dtype=torch.long)}]}))
    msg = worker.recv(5000)
    assert msg.sampling_params.max_tokens == 7 and msg.sampling_params.stop_token_ids == [3]
    assert torch.equal(msg.additional_information["prompt_embeds"], embeds)
    assert msg.additional_information["meta"][:2] == [1, "x"]
    assert torch.equal(msg.additional_information["meta"][2]["codes"], torch.ones(2, dtype=torch.long))
    assert worker.recv(0) is None


def test_unsendable_payload_is_a_clear_error(channels):
    orch, _ = channels
    with pytest.raises(TypeError, match="cannot send a ndarray"):
        import numpy as np

        orch.send_nowait(StageRequest(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                      additional_information={"x": np.zeros(3)}))


def test_unreceived_segments_are_swept(channels):
    orch, worker = channels
    orch.send_nowait(StageRequest(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                  additional_information={"x": torch.zeros(1024)}))
    assert len(shm_segments()) == 1  # the worker never reads it (e.g. it died)
    assert sweep_shared_memory(PREFIX) == 1 and shm_segments() == []


def test_messages_sent_before_the_worker_binds_are_delivered(ipc_dir):
    ctx = zmq.Context()
    in_addr, out_addr = stage_addresses(ipc_dir, 1)
    orch = orchestrator_channel(ctx, in_addr, out_addr)
    orch.send_nowait(StatsRequest(1))  # queued: no worker yet
    assert asyncio.run(orch.recv(10)) is None
    worker = worker_channel(ctx, in_addr, out_addr)
    assert worker.recv(5000) == StatsRequest(1)
    orch.close()
    worker.close()
    ctx.term()
