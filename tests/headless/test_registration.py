"""The registration protocol between a head (StageMaster, on its asyncio loop) and headless
replicas (MasterLink, as a stage worker uses it), in one process over loopback TCP; the stage-based
CLI's flag checks; the pipeline fingerprint. Fast: no stage engine is built."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from tests.pipeline.conftest import wait_until
from tests.server.conftest import free_port
from vllm_omni.engine.load_balancer import make_policy
from vllm_omni.engine.orchestrator import Orchestrator, RuntimeOptions
from vllm_omni.engine.registration import (
    MasterLink, RegistrationRefused, RemoteAttach, pipeline_fingerprint, pipeline_summary,
)
from vllm_omni.engine.replica_pool import StagePool
from vllm_omni.engine.stage_client import StageClient, StageState
from vllm_omni.engine.stage_master import MasterLimits, StageMaster
from vllm_omni.engine.transport_guard import ZapGuard
from vllm_omni.entrypoints.cli.main import main
from vllm_omni.entrypoints.omni_base import load_pipeline

SUMMARY = "model m; async_chunk=False; stages 0:thinker, 1:talker"
HEARTBEAT_TIMEOUT_S = 1.0
INBOX = "tcp://127.0.0.1:9"  # nothing listens there: the head's sends to it just wait


class Head:
    """A StageMaster with two empty stage pools, on a loop thread of its own (with `limits.keys`,
    behind the ZAP handler that the stage fleet runs)."""

    def __init__(self, port: int, limits: MasterLimits | None = None, address: str = "127.0.0.1") -> None:
        self.port = port
        self.ctx = zmq.Context()
        self.zap = ZapGuard(self.ctx, limits.keys) if limits is not None and limits.keys is not None else None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pools = {sid: StagePool(sid, None, 0, make_policy("round-robin")) for sid in (0, 1)}
        self.downs: list[tuple[int, str]] = []
        self.master = StageMaster(self.ctx, address, port, "m", SUMMARY, self.pools, self._client,
                                  heartbeat_interval_s=0.1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                                  stage_init_timeout_s=30.0, limits=limits)

    def _client(self, stage_id, replica, launcher, channel) -> StageClient:
        client = StageClient(stage_id, None, launcher, channel, on_message=lambda *a: None,
                             on_down=lambda sid, reason: self.downs.append((replica, reason)),
                             heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, name=f"stage {stage_id} replica {replica}",
                             heartbeats_from_start=True)
        self.pools[stage_id].replicas[replica] = client
        return client

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def on_loop(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        async def close() -> None:
            for client in self.pools[0].clients() + self.pools[1].clients():
                await client.close(0.1)
            await self.master.close()

        self.call(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()


async def _set_state(client: StageClient, state: StageState) -> None:
    client.state = state


@pytest.fixture
def head():
    h = Head(free_port())
    h.call(h.master.start())
    yield h
    h.close()


@pytest.fixture
def worker_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # also the sockets of a link a failed test left open


def attach(port: int, summary: str = SUMMARY, keys=None) -> RemoteAttach:
    return RemoteAttach("127.0.0.1", port, pipeline_fingerprint(summary), summary, keys)


def test_a_replica_registers_before_or_after_the_head_starts(worker_ctx):
    head = Head(free_port())
    try:
        result: list = []
        t = threading.Thread(target=lambda: result.append(
            MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=30.0)))
        t.start()
        time.sleep(0.5)  # the replica is waiting for a head that is not there yet
        head.call(head.master.start())
        t.join(20)
        link = result[0]
        assert (link.accepted.replica, link.accepted.heartbeat_timeout_s) == (0, HEARTBEAT_TIMEOUT_S)
        assert link.out_addr == f"tcp://127.0.0.1:{link.accepted.out_port}"
        client = head.pools[1].replicas[0]
        assert client.state == StageState.STARTING and client.pid is not None
        link.start()
        time.sleep(5 * 0.1)
        assert link.lost is None  # the head answers its pings
        link.close("stopped")
    finally:
        head.close()


def test_refusals_name_the_reason(head, worker_ctx, caplog):
    other = "model another; async_chunk=False; stages 0:thinker, 1:talker"
    with pytest.raises(RegistrationRefused, match="pipeline config differs") as e:
        MasterLink.register(worker_ctx, attach(head.port, other), 1, INBOX, timeout_s=5.0)
    # The peer learns nothing of the head's pipeline; the head's log shows both.
    assert SUMMARY not in str(e.value) and other in str(e.value)
    assert SUMMARY in caplog.text and other in caplog.text
    with pytest.raises(RegistrationRefused, match="no stage 5"):
        MasterLink.register(worker_ctx, attach(head.port), 5, INBOX, timeout_s=5.0)
    assert head.pools[1].replicas == []


def test_no_head_within_the_timeout(worker_ctx):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no head answered at tcp://127.0.0.1:"):
        MasterLink.register(worker_ctx, attach(free_port()), 1, INBOX, timeout_s=0.5)
    assert time.monotonic() - t0 < 5.0


def test_leave_marks_the_replica_down_at_once(head, worker_ctx):
    link = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=5.0)
    link.start()
    client = head.pools[1].replicas[0]
    head.call(_set_state(client, StageState.UP))  # as if it had sent StageReady
    link.close("stopped")
    # (the head's loop marks the state, then reports the down: wait for both, not the first)
    assert wait_until(lambda: client.state == StageState.DOWN and head.downs, 5.0)
    assert head.downs == [(0, f"headless replica (pid {client.pid} on {client.launcher.host}) left: stopped")]


def test_a_replica_the_head_marked_down_learns_it_and_its_slot_is_reused(head, worker_ctx):
    first = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=5.0)
    first.start()
    head.on_loop(head.pools[1].replicas[0].mark_down, "no heartbeat for 9.0s")
    assert wait_until(lambda: first.lost is not None, 5.0)
    assert "no longer knows this replica" in first.lost
    first.close("stopped")
    again = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=5.0)
    another = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=5.0)
    assert (again.accepted.replica, another.accepted.replica) == (0, 1)
    assert again.accepted.session != first.accepted.session
    again.close("stopped")
    another.close("stopped")


def test_a_replica_notices_that_the_head_is_gone(head, worker_ctx):
    link = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=5.0)
    link.start()
    try:
        head.call(head.master.close())  # as if the head died: its sessions were never closed
        assert wait_until(lambda: link.lost is not None, HEARTBEAT_TIMEOUT_S + 5.0)
        assert "did not answer" in link.lost
    finally:
        link.close("stopped")


def test_waiting_for_stages_names_the_command_that_starts_them(head):
    with pytest.raises(TimeoutError) as e:
        head.call(head.master.wait_for_stages([1], time.monotonic() + 0.2, "init_timeout=0.2s"))
    assert "no headless replica of stage 1 came up within init_timeout=0.2s" in str(e.value)
    assert (f"vllm-omni serve m --headless --stage-id 1 --omni-master-address 127.0.0.1 "
            f"--omni-master-port {head.port}") in str(e.value)


@pytest.fixture(scope="module")
def omni_model(tiny_model):
    return str(tiny_model("qwen2_5_omni"))


def test_the_fingerprint_ignores_per_process_settings(omni_model):
    base = load_pipeline(omni_model, None, None, None, {})
    tuned = load_pipeline(omni_model, None, None, None, {"max_num_seqs": 3, "gpu_memory_utilization": 0.5,
                                                         "num_replicas": 2}, stage_id=1)
    assert tuned.stage(1).engine_args.max_num_seqs == 3 and tuned.stage(1).runtime.num_replicas == 2
    assert tuned.stage(0).engine_args.max_num_seqs == base.stage(0).engine_args.max_num_seqs  # stage 1 alone
    assert pipeline_summary(tuned, omni_model) == pipeline_summary(base, omni_model)
    other = load_pipeline(omni_model, None, None, None, {}, async_chunk=not base.async_chunk)
    assert pipeline_fingerprint(pipeline_summary(other, omni_model)) != \
        pipeline_fingerprint(pipeline_summary(base, omni_model))


def test_a_head_of_one_stage_needs_a_master(omni_model):
    pipeline = load_pipeline(omni_model, None, None, None, {})
    with pytest.raises(ValueError, match=r"stages \[1, 2\] must register as headless stages, which needs "
                                         "--omni-master-address"):
        Orchestrator(pipeline, omni_model, RuntimeOptions(local_stage=0))
    with pytest.raises(ValueError, match="no such stage"):
        Orchestrator(pipeline, omni_model, RuntimeOptions(local_stage=7, master_address="127.0.0.1", master_port=1))
    with pytest.raises(ValueError, match="give both"):
        RuntimeOptions(master_address="127.0.0.1")
    head = Orchestrator(pipeline, omni_model, RuntimeOptions(local_stage=0, master_address="127.0.0.1",
                                                             master_port=1))
    assert [p.num_replicas for p in head.pools.values()] == [1, 0, 0]  # the rest come from registrations
    assert head.fleet.health()[1].state == StageState.STARTING
    assert "none has registered yet" in head.fleet.health()[1].reason


@pytest.mark.parametrize("argv, message", [
    (["--headless"], "--headless needs --stage-id"),
    (["--headless", "--stage-id", "1"], "--headless needs --omni-master-address"),
    (["--stage-id", "0", "--omni-master-address", "h"], "--omni-master-address and --omni-master-port go together"),
    (["--stage-id", "-1"], "--stage-id must be >= 0"),
    (["--omni-replica-address", "10.0.0.2"], "--omni-replica-address is the address a --headless stage advertises"),
    (["--headless", "--stage-id", "1", "-oma", "h", "-omp", "1", "--worker-backend", "ray"],
     "does not combine with --worker-backend ray"),
    (["--stage-id", "0", "-oma", "h", "-omp", "70000"], "--omni-master-port must be a TCP port"),
])
def test_stage_cli_flag_combinations_are_refused_before_anything_starts(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
