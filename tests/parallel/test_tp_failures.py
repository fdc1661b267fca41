"""A broken tensor-parallel group fails the engine at once, never hangs it (CPU, gloo, 2 ranks).

- a rank killed during a step: that step raises TensorParallelError within seconds;
- rank 0 failing after the step's collectives (its sampler): the other rank finished the
  step, so only the step fails and the engine goes on; a rank killed while the engine is
  then idle fails the next health check (a stage goes down without waiting for a request);
- rank 0 failing before a collective the other rank then waits in: the group is broken.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tests.pipeline.conftest import pid_alive, wait_until
from vllm_omni import LLM, SamplingParams
from vllm_omni.core import tp_executor
from vllm_omni.core.tp_executor import TensorParallelError

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def tp2(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2)
    yield llm
    llm.engine.runner.close()


def rank1_pid(llm: LLM) -> int:
    return llm.engine.runner.ranks.procs[0].pid


def test_rank_killed_during_a_step_fails_it_promptly(tp2):
    engine = tp2.engine
    engine.add_request("long", list(range(5, 40)), LONG)
    engine.step()
    engine.step()
    os.kill(rank1_pid(tp2), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        for _ in range(LONG.max_tokens):
            engine.step()
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelError):  # and stays failed
        engine.has_unfinished_requests()


def test_rank0_failing_after_the_collectives_fails_only_that_step_then_idle_rank_death(tp2):
    runner = tp2.engine.runner.runner  # rank 0's own ARModelRunner
    sample = runner._sample

    def sampler_fails_once(*args):
        runner._sample = sample
        raise RuntimeError("rank 0's sampler broke")

    runner._sample = sampler_fails_once
    # The group is intact after the failed step, so only that step's request fails (isolated_step.py).
    failed = tp2.generate([{"prompt_token_ids": [3, 4, 5]}], SHORT, use_tqdm=False)
    assert "sampler broke" in failed[0].error and failed[0].outputs[0].finish_reason == "error"
    # Rank 1 came out of that step: the group serves the next request.
    out = tp2.generate([{"prompt_token_ids": [3, 4, 5]}], SHORT, use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 4 and pid_alive(rank1_pid(tp2))

    # Now idle: a rank that dies fails the next health check (a stage polls it between messages).
    pid = rank1_pid(tp2)
    os.kill(pid, signal.SIGKILL)

    def failed() -> bool:
        try:
            tp2.engine.has_unfinished_requests()
        except TensorParallelError as e:
            return f"pid {pid}" in str(e)
        return False

    assert wait_until(failed, 10.0)


def test_rank0_failing_before_a_collective_breaks_the_group(tp2, monkeypatch):
    monkeypatch.setattr(tp_executor, "SETTLE_TIMEOUT_S", 2.0)
    runner = tp2.engine.runner.runner
    prepare = runner._prepare

    def prepare_then_fail(items):
        prepare(items)
        raise RuntimeError("rank 0 broke before the forward")

    runner._prepare = prepare_then_fail  # rank 1 goes on into the forward's first all-reduce and waits there
    pid = rank1_pid(tp2)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="did not finish step"):
        tp2.generate([{"prompt_token_ids": [3, 4, 5]}], SHORT, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert wait_until(lambda: not pid_alive(pid), 10.0)  # the stuck rank was killed, not left behind


def test_a_model_that_does_not_split_fails_at_startup_without_leftovers(tiny_model):
    path = str(tiny_model("qwen3", num_attention_heads=3, num_key_value_heads=1))
    with pytest.raises((ValueError, TensorParallelError), match="does not divide num_attention_heads=3"):
        LLM(path, tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("vllm-omni-tp-rank")]
