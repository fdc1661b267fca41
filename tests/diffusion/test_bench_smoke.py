"""benchmarks/bench_diffusion.py runs on the CPU with the tiny pipeline (the H200 run uses the real
architecture); its numbers are not checked here, only that every configuration runs."""
from __future__ import annotations

import importlib.util
import json
import sys
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


def test_bench_video_smoke(tmp_path):
    """benchmarks/bench_video.py on the tiny Wan checkpoints: each model and phase runs, ours equals
    diffusers; an FP8 variant (run after the video: it quantizes the shared weights) is timed apart."""
    spec = importlib.util.spec_from_file_location("bench_video", BENCH.with_name("bench_video.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_video"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--tiny", "--warmup", "0", "--iters", "1", "--video-steps", "2", "--variants",
                         "TORCH_SDPA+fp8", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["model"] for r in result["rows"]] == ["Wan2.2-T2V-A14B", "Wan2.2-TI2V-5B"]
    for row in result["rows"]:
        assert row["ours_ms_per_step"] > 0 and row["diffusers_s_per_video"] > 0
        assert row["step_max_abs_diff"] < 1e-3 and row["video_max_abs_diff"] < 2e-3
        assert row["ours_ms_per_step[TORCH_SDPA+fp8]"] > 0
        assert 0 < row["step_max_abs_diff[TORCH_SDPA+fp8]"] < 1.0  # FP8 weights: near, not equal
