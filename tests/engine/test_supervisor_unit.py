"""The supervisor's states, without a pipeline (tests/reliability/test_supervision.py runs real stages)."""
from __future__ import annotations

import asyncio

from vllm_omni.engine.supervisor import StageSupervisor


def test_a_stage_with_no_restart_left_is_down_at_once_never_restarting():
    restarts: list[int] = []

    async def restart(stage_id):
        restarts.append(stage_id)

    async def run():
        supervisor = StageSupervisor(restart, max_restarts=0)
        supervisor.on_down(0, "process 1 was killed by SIGKILL")
        # A reader on another thread may look before the loop turns again: no "restarting" then.
        assert not supervisor.restarting(0)
        assert "SIGKILL" in supervisor.gave_up(0)
        await asyncio.sleep(0)
        assert not supervisor.restarting(0)

    asyncio.run(run())
    assert restarts == []


def test_a_stage_with_restarts_left_is_restarting_until_it_is_back():
    async def run():
        back = asyncio.Event()

        async def restart(stage_id):
            back.set()

        supervisor = StageSupervisor(restart, max_restarts=1, backoff_s=0.0)
        supervisor.on_down(0, "exited with code 1")
        assert supervisor.restarting(0) and supervisor.gave_up(0) is None
        await asyncio.wait_for(back.wait(), 5.0)
        await asyncio.sleep(0)
        assert not supervisor.restarting(0) and supervisor.gave_up(0) is None

    asyncio.run(run())
