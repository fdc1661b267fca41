"""A dead stage fails only the requests that need it: with the talker killed, text-only
requests still run through the thinker while speech requests fail at once, naming the stage.
The thinker runs as a thread (in_threads); the talker, killed here, and code2wav, which close()
must stop, are stage processes."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import in_threads
from tests.e2e.conftest import short_params
from tests.pipeline.conftest import pid_alive, wait_until
from vllm_omni import AsyncOmni
from vllm_omni.entrypoints.async_omni import RequestFailedError

PROMPT = {"messages": [{"role": "user", "content": "Hello there"}]}


async def drain(omni, prompt, **kwargs):
    return [out async for out in omni.generate(prompt, short_params(), **kwargs)]


def test_text_requests_survive_a_dead_talker(omni_dir):
    omni = AsyncOmni(model=str(omni_dir), max_stage_restarts=0,  # the talker stays down
                     stage_overrides=in_threads(1))
    pids = [h.pid for h in omni.stage_health()]
    assert pids[0] == os.getpid() and os.getpid() not in pids[1:]
    try:
        before = asyncio.run(drain(omni, PROMPT, modalities=["text"]))
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: omni.stage_health()[1].state.value == "down", 10.0)
        after = asyncio.run(asyncio.wait_for(drain(omni, PROMPT, modalities=["text"]), 30.0))
        assert after[-1].request_output.outputs[0].token_ids == before[-1].request_output.outputs[0].token_ids
        with pytest.raises(RequestFailedError, match=r"stage 1 \(talker\)"):
            asyncio.run(asyncio.wait_for(drain(omni, PROMPT), 5.0))
    finally:
        omni.close()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids[1:]), 10.0)
