"""benchmarks/bench_replicas.py runs on the CPU with the tiny Qwen2.5-Omni; its numbers are not
checked here (docs/benchmarks.md records them), only that each configuration runs and routes.
The talker replicas, which the benchmark is about, run as processes; the thinker and code2wav
as threads (the benchmark's --other-stages-in-threads), on the session's tiny checkpoint."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_replicas.py"


def test_bench_replicas_smoke(omni_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_replicas", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--model", str(omni_dir), "--other-stages-in-threads", "--num-requests", "4",
                         "--concurrency", "2", "--codec-tokens", "8", "--policies", "least-queue-length",
                         "--json", str(out)])
    assert json.loads(out.read_text()) == result
    throughput = result["throughput"]
    assert throughput["one_replica"]["routed_per_replica"] == [4]
    assert throughput["two_replicas"]["routed_per_replica"] == [2, 2]  # round robin
    assert throughput["ratio"] > 0
    (slowed,) = result["slow_replica"]
    assert slowed["policy"] == "least-queue-length" and sum(slowed["routed_per_replica"]) == 4
    assert 0 < slowed["p50_s"] <= slowed["p90_s"]
