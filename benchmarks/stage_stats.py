"""Per-stage counters of a benchmark run, shared by bench_omni_e2e.py and bench_tts.py.

The orchestrator counts, per stage, the requests it finished, their output tokens (a talker's
codec frames, code2wav's none), busy time (request-seconds between handing a request to the
stage and its last output: overlapping requests add up), early starts over streaming edges
and flow-control pauses. Take them before the engine closes.
"""
from __future__ import annotations

from typing import Any


def stage_counters(omni: Any) -> list[dict[str, Any]]:
    """One row per stage of an (Async)Omni: its model_stage, devices and counters so far."""
    counters = omni._runtime.orchestrator.stage_counters
    return [{"stage": s.model_stage, "devices": s.runtime.devices, **dict(counters[s.stage_id])}
            for s in omni.pipeline.stages]


def print_stage_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The rows of `stage_counters` for each named run, as one table."""
    print("per stage (all levels): requests, output tokens, busy s, early starts, pauses")
    for name, stages in runs.items():
        for st in stages:
            print(f"  {name:<22}{st['stage']:<10}{st.get('requests', 0):>7}{st.get('output_tokens', 0):>9}"
                  f"{st.get('busy_ms', 0) / 1000:>9.2f}{st.get('early_starts', 0):>7}{st.get('pauses', 0):>7}")
