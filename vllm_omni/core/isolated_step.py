"""Run a scheduled step so that a request that breaks it fails alone.

    result, failures = execute_isolating_failures(runner, sched)   # failures: request id -> error

A batched forward pass that raises (a bad per-request input reaching the model, a kernel
that rejects one request's shape) would otherwise fail every request in the batch. Here the
step is re-run one request at a time: a request that still fails on its own is reported in
`failures`; the others get exactly the result they would have got alone.

Re-running is safe because a step's effects are idempotent until the engine advances the
requests: the KV cache rows it writes are the same rows written again, and per-request
sampling generators are restored to their state before the failed attempt. A runner that
is itself broken (its health check raises) is not a request's fault: that error propagates.
"""
from __future__ import annotations

import logging

from vllm_omni.core.model_runner import ARModelRunner, PendingTokens, RunnerOutput
from vllm_omni.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def execute_isolating_failures(runner: ARModelRunner, sched: SchedulerOutput, previous: PendingTokens | None = None,
                               defer: bool = False) -> tuple[RunnerOutput, dict[str, str]]:
    """`previous` and `defer` as in ARModelRunner.execute (async scheduling; a runner without it
    gets neither); the one-by-one runs read their tokens at once."""
    generators = {item.request.request_id: item.request.generator for item in sched.scheduled
                  if item.request.generator is not None}
    saved = {rid: g.get_state() for rid, g in generators.items()}

    def run(step: SchedulerOutput, defer_tokens: bool) -> RunnerOutput:
        if previous is None and not defer:  # also what a runner without async scheduling takes
            return runner.execute(step)
        return runner.execute(step, previous, defer_tokens)

    try:
        return run(sched, defer), {}
    except Exception as e:  # noqa: BLE001 - find the culprit below instead of failing the batch
        runner.check_health()  # a runner that can run no more steps (a lost tensor-parallel rank) fails the engine
        if len(sched.scheduled) == 1:
            return RunnerOutput(), {sched.scheduled[0].request.request_id: _describe(e)}
        logger.warning("a step of %d requests failed (%s: %s); running them one by one",
                       len(sched.scheduled), type(e).__name__, e)
    if previous is not None:  # its input copies are done before the runs below refill the staging buffers
        previous.result()
    merged, failures = RunnerOutput(), {}
    for item in sched.scheduled:
        rid = item.request.request_id
        if rid in saved:
            generators[rid].set_state(saved[rid])
        try:
            part = run(SchedulerOutput(scheduled=[item]), False)
        except Exception as e:  # noqa: BLE001 - this request breaks the step on its own
            failures[rid] = _describe(e)
            continue
        merged.sampled.update(part.sampled)
        merged.logprobs.update(part.logprobs)
        merged.hidden_states.update(part.hidden_states)
    return merged, failures


def _describe(exc: Exception) -> str:
    return f"the engine step failed for this request: {type(exc).__name__}: {exc}"

