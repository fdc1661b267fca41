"""benchmarks/bench_diffusion.py runs on the CPU with the tiny pipeline (the H200 run uses the real
architecture); its numbers are not checked here, only that every configuration runs."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_diffusion.py"


def test_bench_diffusion_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_diffusion", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--tiny", "--size", "32", "--steps", "2", "--batch-sizes", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["batch"] for r in result["rows"]] == [2]
    for row in result["rows"]:
        assert row["ours_s_per_image"] > 0 and row["diffusers_s_per_image"] > 0 and row["speedup"] > 0
