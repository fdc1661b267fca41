"""Message encoding: zero-copy frames, shared memory above the threshold, raw-byte dtypes."""
from __future__ import annotations

import asyncio
import os
import shutil

import msgspec
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


# ------------------------------------------------------------------ what a receiver refuses (issue 41)


def _segment(name: str, nbytes: int) -> None:
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    shm.buf[:nbytes] = b"\x07" * nbytes
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()


def _output_naming(segment: str, nbytes: int) -> bytes:
    """A worker -> orchestrator message whose one tensor points at shared memory `segment`."""
    ref = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["torch.uint8", [nbytes], -1, segment]))
    return msgspec.msgpack.encode({"type": "outputs", "stage_id": 0, "outputs": [
        {"request_id": "a", "finished": True, "multimodal_output": {"x": ref}}]})


def test_an_output_naming_a_foreign_segment_is_dropped_and_the_segment_left_alone(channels):
    """A stage may only name segments made with the prefix the orchestrator gave it: one that names
    another's segment (here one of the orchestrator's own) gets nothing read, nothing deleted."""
    orch, worker = channels
    foreign = f"{ORCH}not-yours"
    _segment(foreign, 4096)
    worker.outbox.send(_output_naming(foreign, 4096))
    worker.outbox.send(_output_naming("../../etc/passwd", 16))
    worker.send(StageOutputBatch(0, [StageOutput(request_id="b", finished=True)]))
    msg = asyncio.run(orch.recv(5000))
    assert msg.outputs[0].request_id == "b"  # the reader skipped the bad messages and went on
    assert foreign in shm_segments()  # untouched
    drops = orch.guard.counter.snapshot()
    assert [(k.socket, k.reason, n) for k, n in drops.items()] == [("outputs", "foreign_shm", 2)]
    own = f"{WORKER}mine"  # the same message naming a segment of the worker's: read and unlinked
    _segment(own, 4096)
    worker.outbox.send(_output_naming(own, 4096))
    msg = asyncio.run(orch.recv(5000))
    assert msg.outputs[0].multimodal_output["x"].tolist() == [7] * 4096 and own not in shm_segments()


def test_over_tcp_no_segment_name_is_accepted(ipc_dir):
    from vllm_omni.engine.transport import DroppedMessage, MessageCodec

    sender = MessageCodec(StageOutputBatch, 16, WORKER)
    receiver = MessageCodec(StageOutputBatch, 16, ORCH, LinkGuard(accept_shm_prefix=None))
    frames = sender.encode(StageOutputBatch(0, [StageOutput(request_id="a", finished=True, multimodal_output={"x": torch.ones(64)})]))
    [segment] = shm_segments()
    with pytest.raises(DroppedMessage, match="inline only") as e:
        receiver.decode([zmq.Frame(f) for f in frames])
    assert e.value.reason == "foreign_shm" and shm_segments() == [segment]
    sweep_shared_memory(PREFIX)


@pytest.mark.parametrize("shape, payload, reason", [
    ([1 << 26], b"", "undecodable"),  # claims 256 MiB over an empty frame: never allocated
    ([10 ** 12], b"", "undecodable"),
    ([2, 3], b"\x00" * 5, "undecodable"),  # frame and shape disagree
    (["x"], b"", "undecodable"),
    ([4096], b"\x00" * 16384, "oversized"),  # over the receiver's 8 KiB cap
])
def test_tensors_whose_sizes_do_not_add_up_are_dropped(shape, payload, reason):
    from vllm_omni.engine.transport import DroppedMessage, MessageCodec

    ref = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["torch.float32", shape, 1, ""]))
    header = msgspec.msgpack.encode({"type": "outputs", "stage_id": 0, "outputs": [
        {"request_id": "a", "finished": True, "multimodal_output": {"x": ref}}]})
    receiver = MessageCodec(StageOutputBatch, 16, ORCH, LinkGuard(max_message_bytes=8192))
    with pytest.raises(DroppedMessage) as e:
        receiver.decode([zmq.Frame(header), zmq.Frame(payload)])
    assert e.value.reason == reason
    ref = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["torch.float32", [2], 1, ""]))  # the same, well-formed
    good = header.replace(msgspec.msgpack.encode(msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
        ["torch.float32", shape, 1, ""]))), msgspec.msgpack.encode(ref))
    assert receiver.decode([zmq.Frame(good), zmq.Frame(b"\x00" * 8)]).outputs[0].multimodal_output["x"].shape == (2,)


def test_a_sender_refuses_a_message_over_the_cap():
    from vllm_omni.engine.transport import MessageCodec

    codec = MessageCodec(StageOutputBatch, 1 << 20, WORKER, LinkGuard(max_message_bytes=4096))
    with pytest.raises(ValueError, match="--omni-max-message-bytes"):
        codec.encode(StageOutputBatch(0, [StageOutput(request_id="a", finished=True, multimodal_output={"x": torch.zeros(2048)})]))
    assert shm_segments() == []  # the segment made for it went with it
    with pytest.raises(ValueError, match="--omni-max-message-bytes"):  # the header alone, too
        codec.encode(StageOutputBatch(0, [StageOutput(request_id="a", finished=True, new_token_ids=[7] * 5000)]))


def test_garbage_in_a_stage_inbox_is_dropped_and_the_worker_reads_on(ipc_dir):
    ctx = zmq.Context()
    in_addr, out_addr = stage_addresses(ipc_dir, 2)
    worker = worker_channel(ctx, in_addr, out_addr)
    peer = ctx.socket(zmq.PUSH)
    peer.connect(in_addr)
    peer.send(b"\x01")  # one byte that is not a message
    peer.send_multipart([b"\x81\xa4type\xa5nope", b"x"])
    peer.send(msgspec.msgpack.encode(StatsRequest(7)))
    assert worker.recv(5000) == StatsRequest(7)
    assert sum(worker.guard.counter.snapshot().values()) == 2
    peer.close(linger=0)
    worker.close()
    ctx.term()
