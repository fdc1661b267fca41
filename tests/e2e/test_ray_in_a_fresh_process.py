"""The Ray backend's tests (test_qwen2_5_omni_ray.py), run by pytest in an interpreter of their own.

Without an address, `Omni(worker_backend="ray")` starts a local Ray from its own process, and Ray
forks its GCS server from there. In a pytest process that has already run a thousand tests (their
threads, pools and handlers), that child sometimes died before it ran (no GCS log at all; "Ray did
not start (or connect) within 120.0s", twice in three full runs on a 2-core machine), while the
module alone passed every time. A user's driver is such a fresh process, so the module gets one:
its tests, fixtures and assertions are unchanged, and a failure prints their report.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import RAY_IN_THIS_PROCESS, RAY_MODULE

REPO = Path(__file__).resolve().parents[2]


def test_the_ray_backend_tests_pass_in_a_fresh_interpreter():
    env = {**os.environ, RAY_IN_THIS_PROCESS: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                          str(Path(__file__).with_name(RAY_MODULE))],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]
