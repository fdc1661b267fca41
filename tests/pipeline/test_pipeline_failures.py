"""Failure handling with real processes: dead and silent stages, dead parents, bad startups (a
failed build is reported the same way by a stage thread, which starts faster)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import in_threads
from tests.pipeline.conftest import pid_alive, wait_until
from vllm_omni import AsyncOmni, Omni, SamplingParams
from vllm_omni.entrypoints.async_omni import RequestFailedError

REPO = Path(__file__).resolve().parents[2]
LONG = [SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True), None, None]


def test_killed_stage_fails_its_requests_and_the_rest_stays_up(toy_pipeline):
    # Without restarts (tests/reliability covers them): the stage stays down. The thinker (killed)
    # and the talker (which close() must stop) are processes; code2wav is a thread.
    omni = AsyncOmni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.long_yaml),
                     max_stage_restarts=0, stage_overrides={"2": {"process": False}})
    pids = [h.pid for h in omni.stage_health()][:2]
    assert os.getpid() not in pids
    try:
        async def run():
            tasks = [asyncio.create_task(_drain(omni, {"prompt_token_ids": [7, 8, i]}, LONG)) for i in range(3)]
            while (await omni.get_stage_stats(0)).num_unfinished < 3:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            errors = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
            return time.monotonic() - t0, errors

        elapsed, errors = asyncio.run(run())
        assert elapsed < 5.0
        assert all(isinstance(e, RequestFailedError) and e.stage_id == 0 for e in errors), errors
        assert "stage 0 (thinker) is down" in str(errors[0]) and "SIGKILL" in str(errors[0])
        health = omni.stage_health()
        assert [h.state.value for h in health] == ["down", "up", "up"]
        assert "SIGKILL" in health[0].reason
        # The orchestrator is still serving: a new request fails at once, naming the stage.
        with pytest.raises(RequestFailedError, match=r"stage 0 \(thinker\) is down"):
            asyncio.run(asyncio.wait_for(_drain(omni, "hello"), 5.0))
    finally:
        omni.close()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10.0)


async def _drain(omni, prompt, params=None):
    return [out async for out in omni.generate(prompt, params)]


def test_silent_stage_is_down_after_the_heartbeat_deadline(toy_pipeline):
    from vllm_omni.config import single_stage_pipeline
    from vllm_omni.engine.orchestrator import RuntimeOptions
    from vllm_omni.engine.runtime import OmniRuntime

    pipeline = single_stage_pipeline(str(toy_pipeline.thinker))
    runtime = OmniRuntime(pipeline, str(toy_pipeline.thinker), RuntimeOptions(heartbeat_timeout_s=1.5,
                                                                              max_stage_restarts=0))
    pid = runtime.health()[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)  # alive but silent, like a hung stage
        assert wait_until(lambda: runtime.health()[0].state.value == "down", 6.0)
        assert "no heartbeat" in runtime.health()[0].reason
        assert wait_until(lambda: not pid_alive(pid), 5.0)  # a DOWN stage is killed, freeing its devices
    finally:
        runtime.close()


def test_parent_killed_with_sigkill_leaves_no_stage_process(toy_pipeline, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        from vllm_omni import Omni
        if __name__ == "__main__":
            omni = Omni(model={str(toy_pipeline.thinker)!r}, stage_configs_path={str(toy_pipeline.yaml)!r})
            print(json.dumps([h.pid for h in omni.stage_health()]), flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=str(REPO), env=env, text=True)
    try:
        line = _read_line(proc, 120.0)
        pids = json.loads(line)
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10.0), [p for p in pids if pid_alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"the parent process printed nothing within {timeout_s}s")
    return proc.stdout.readline()


def test_startup_failure_names_the_stage(toy_pipeline, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(toy_pipeline.yaml.read_text().replace(str(toy_pipeline.talker), str(tmp_path / "missing"), 1))
    with pytest.raises(RuntimeError, match=r"stage 1 \(talker\) failed to start: initialization failed"):
        # The worker reports its failed build the same way from a thread (cheaper to start).
        Omni(model=str(toy_pipeline.thinker), stage_configs_path=str(bad), stage_overrides=in_threads(3))


def test_startup_timeout_names_the_stage(toy_pipeline):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stage 0 \(thinker\) did not come up within stage_init_timeout=0.2s"):
        Omni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.yaml), stage_init_timeout=0.2)
    assert time.monotonic() - t0 < 30


def test_in_process_stage(toy_pipeline):
    # runtime.process: false runs the same worker loop in a thread of this process.
    overrides = {"0": {"process": False}}
    with Omni(model=str(toy_pipeline.thinker), stage_overrides=overrides) as omni:
        assert omni.stage_health()[0].pid == os.getpid()
        out, = omni.generate({"prompt_token_ids": [5, 6, 7]}, [SamplingParams(temperature=0.0, max_tokens=5)],
                             use_tqdm=False)
        from vllm_omni import LLM

        ref = LLM(str(toy_pipeline.thinker)).generate({"prompt_token_ids": [5, 6, 7]},
                                                      SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert out.request_output.outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert out.request_output.outputs[0].text == ref[0].outputs[0].text
