"""A stage client's view of its stage's liveness (issue 41), over a real ipc link with this test
playing the worker: a stage that misses its heartbeats is DOWN at once but not killed, is UP again
the moment it speaks (the requests it held are aborted there), and is killed only when it stays
silent past the hang deadline; a reader that dies takes its stage down. The same behaviour end to
end, with SIGSTOP and SIGCONT on real processes, is in tests/headless/test_secure_cluster.py."""
from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import zmq

from vllm_omni.engine.messages import AbortRequests, Heartbeat, StageReady
from vllm_omni.engine.stage_client import HANG_FACTOR, StageClient, StageState
from vllm_omni.engine.transport import OrchestratorChannel, WorkerChannel, make_ipc_dir, stage_addresses

TIMEOUT_S = 0.4


class Launcher:
    """Stands for the stage's process: it only records whether it was killed."""

    pid = os.getpid()

    def __init__(self) -> None:
        self.killed = False

    def start(self, on_exit) -> None:
        return

    def kill(self) -> None:
        self.killed = True

    async def stop(self, timeout_s: float, graceful: bool) -> None:
        return

    def stop_blocking(self, timeout_s: float) -> None:
        return


class Link:
    def __init__(self) -> None:
        self.ipc_dir = make_ipc_dir()
        self.ctx = zmq.Context()
        in_addr, out_addr = stage_addresses(self.ipc_dir, 0)
        self.worker = WorkerChannel(self.ctx, in_addr, out_addr, 1 << 20, "")
        self.downs: list[str] = []
        self.launcher = Launcher()
        channel = OrchestratorChannel(self.ctx, in_addr, out_addr, 1 << 20, "")
        self.client = StageClient(0, "thinker", self.launcher, channel, on_message=lambda *a: None,
                                  on_down=lambda sid, reason: self.downs.append(reason), heartbeat_timeout_s=TIMEOUT_S)

    async def up(self) -> None:
        self.client.start()
        self.worker.send(StageReady(0, os.getpid(), {}))
        await self.client.wait_ready(time.monotonic() + 5, "5s")

    async def until(self, check, within_s: float) -> float:
        t0 = time.monotonic()
        while not check():
            assert time.monotonic() - t0 < within_s, (self.client.state, self.client.reason)
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    def close(self) -> None:
        self.client.channel.close()
        self.worker.close()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture
def link():
    lnk = Link()
    yield lnk
    lnk.close()


def test_a_silent_stage_is_down_at_once_and_up_again_when_it_speaks(link):
    async def run() -> None:
        await link.up()
        client = link.client
        await link.until(lambda: client.state == StageState.DOWN, TIMEOUT_S + 2.0)  # no heartbeat was sent
        assert client.silent and "no heartbeat" in client.reason and not link.launcher.killed
        assert len(link.downs) == 1
        client.remember_orphans(["r#1", "r#2"])  # what the fleet does: the requests it held
        link.worker.send(Heartbeat(0, os.getpid()))
        await link.until(lambda: client.state == StageState.UP, 2.0)
        assert client.reason is None and not client.silent
        assert link.worker.recv(2000) == AbortRequests(["r#1", "r#2"])  # they failed or moved meanwhile
        # Silent for good this time: killed at the hang deadline, and reported down once more.
        waited = await link.until(lambda: link.launcher.killed, HANG_FACTOR * TIMEOUT_S + 3.0)
        assert waited >= (HANG_FACTOR - 1) * TIMEOUT_S
        assert client.state == StageState.DOWN and not client.silent and "hung, killed" in client.reason
        assert len(link.downs) == 3
        link.worker.send(Heartbeat(0, os.getpid()))  # too late: a killed stage stays down
        await asyncio.sleep(0.2)
        assert client.state == StageState.DOWN

    asyncio.run(run())


def test_a_reader_that_dies_takes_its_stage_down(link):
    async def run() -> None:
        await link.up()
        link.client.channel.from_worker.close()  # its socket breaks under it
        await link.until(lambda: link.client.state == StageState.DOWN, 5.0)
        assert link.client.reason.startswith("its reader failed")
        assert link.launcher.killed and link.downs == [link.client.reason]

    asyncio.run(run())
