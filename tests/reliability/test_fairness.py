"""Resource fairness: admission counts prompts (first come, first served), a request's fan-out
is capped, a client cannot push a stage past its max_tokens ceiling."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.reliability.conftest import MAX_CONCURRENT, MAX_PROMPTS, NAME
from vllm_omni.entrypoints.openai.admission import AdmissionGate
from vllm_omni.entrypoints.openai.errors import APIError

# ------------------------------------------------------------------ the gate (asyncio, no server)


def test_admission_counts_slots_and_serves_in_arrival_order():
    async def run() -> list[str]:
        gate = AdmissionGate(max_running=4, max_queued=16, wait_timeout_s=5)
        order: list[str] = []
        held = await gate.admit(3)
        assert (gate.running, gate.queued) == (3, 0)

        async def waiter(name: str, slots: int) -> None:
            ticket = await gate.admit(slots)
            order.append(name)
            await asyncio.sleep(0.01)
            ticket.release()

        # "big" needs all 4 slots; the small ones behind it must not overtake it.
        tasks = [asyncio.create_task(waiter("big", 4))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(waiter(f"small{i}", 1)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert gate.queued == 7 and order == []  # one slot is free, but "big" is first in line
        held.release()
        await asyncio.gather(*tasks)
        assert (gate.running, gate.queued) == (0, 0)
        return order

    assert asyncio.run(run()) == ["big", "small0", "small1", "small2"]


def test_admission_refuses_a_full_queue_and_a_long_wait():
    async def run() -> None:
        gate = AdmissionGate(max_running=4, max_queued=2, wait_timeout_s=0.2)
        held = await gate.admit(4)
        with pytest.raises(APIError) as full:
            await gate.admit(3)  # 3 queued prompts > max_queued
        assert full.value.status == 429
        with pytest.raises(APIError) as slow:
            await gate.admit(1)
        assert slow.value.status == 429 and gate.queued == 0
        waiter = asyncio.create_task(gate.admit(1))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client went away while queued: it takes no slot
        await asyncio.gather(waiter, return_exceptions=True)
        held.release()
        assert (gate.running, gate.queued) == (0, 0)
        blocker = await gate.admit(4)
        queued = asyncio.create_task(gate.admit(2))
        await asyncio.sleep(0)
        gate.close()  # shutdown: waiters and newcomers get 503
        for pending in (queued, gate.admit(1)):
            with pytest.raises(APIError) as closed:
                await pending
            assert closed.value.status == 503
        blocker.release()
        assert (gate.running, gate.queued) == (0, 0)

    asyncio.run(run())


# ------------------------------------------------------------------ through the server


def test_a_batch_of_prompts_takes_one_slot_per_prompt(server):
    seen: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(server.running() or 0.0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = server.post("/v1/completions", {"model": NAME, "prompt": [[5, 6, 7]] * MAX_PROMPTS, "max_tokens": 64,
                                            "ignore_eos": True})
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS
    assert max(seen) == MAX_PROMPTS and max(seen) <= MAX_CONCURRENT
    server.assert_serving()


def test_the_talker_cannot_be_pushed_past_its_ceiling(server):
    r = server.chat(sampling_params_list=[None, {"max_tokens": 2048, "ignore_eos": True}, None])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "sampling_params_list[1].max_tokens"
    assert "at most 24 tokens" in error["message"]
    within = server.chat(sampling_params_list=[None, {"max_tokens": 24, "ignore_eos": True}, None])
    assert within.status_code == 200, within.text
