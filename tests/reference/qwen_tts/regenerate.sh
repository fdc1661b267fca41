#!/usr/bin/env bash
# Regenerates the qwen-tts reference fixtures (fixtures/) from the tiny checkpoints.
#   bash tests/reference/qwen_tts/regenerate.sh        (from the repository root)
# Builds the reference venv once (setup_reference.sh, cached), builds the tiny checkpoints
# with the project venv (PYTHON, default: python), then runs qwen-tts on them.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
PYTHON="${PROJECT_PYTHON:-python}"
REF_PY="$(bash "$HERE/setup_reference.sh" | tail -n 1)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# One tiny checkpoint per entry of cases.CHECKPOINTS, as the tests build them (seed 0).
PYTHONPATH="$ROOT:$HERE" "$PYTHON" -c "
import sys
from cases import CHECKPOINTS
from vllm_omni.testing.tiny_models import make_tiny_model
for name, overrides in CHECKPOINTS.items():
    make_tiny_model('qwen3_tts', sys.argv[1] + '/' + name, seed=0, **overrides)
" "$WORK"
HF_HUB_OFFLINE=1 "$REF_PY" "$HERE/make_reference.py" "$WORK" "$HERE/fixtures"
