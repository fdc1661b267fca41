"""What a sustained benchmark run needs (vllm_omni/entrypoints/cli/bench/sustained.py)."""
from __future__ import annotations

import math

from vllm_omni.entrypoints.cli.bench.sustained import sustained_count, why_short


def test_closed_loops_send_four_times_their_concurrency_and_open_loops_thirty_seconds_of_arrivals():
    assert sustained_count(8, concurrency=64) == 256 and "4 x the concurrency" in why_short(8, concurrency=64)
    assert sustained_count(300, concurrency=64) == 300 and why_short(300, concurrency=64) is None
    assert sustained_count(200, rate=20.0) == 600 and "30 s of sustained arrivals" in why_short(200, rate=20.0)
    assert sustained_count(400, rate=math.inf) == 400 and why_short(10, rate=math.inf) is None  # all at once
    assert sustained_count(10, concurrency=4, rate=1.0) == 30
