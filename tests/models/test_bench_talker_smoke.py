"""benchmarks/bench_talker_step.py runs on the CPU with the tiny talkers of both families (the H200
run uses the real architectures); its numbers are not checked here, only that each batch runs
its timed steps through the family's own bridge."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_bench_talker_step_smoke(tmp_path, family):
    out = tmp_path / "talker.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_talker_step.py"), "--family", family,
                    "--batches", "1,3", "--prompt-words", "4", "--reply-rows", "5", "--context", "4", "--steps", "3",
                    "--json", str(out)], check=True, cwd=tmp_path, timeout=300)
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    assert all(row["ms_per_step"] > 0 and row["admit_ms"] > 0 for row in result["rows"])
