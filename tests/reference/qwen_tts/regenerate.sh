#!/usr/bin/env bash
# Regenerates the qwen-tts reference fixtures (fixtures/) from the tiny checkpoints.
#   bash tests/reference/qwen_tts/regenerate.sh        (from the repository root)
# Builds the reference venv once (setup_reference.sh, cached), builds the three tiny checkpoints
# with the project venv (PYTHON, default: python), then runs qwen-tts on them.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
PYTHON="${PROJECT_PYTHON:-python}"
REF_PY="$(bash "$HERE/setup_reference.sh" | tail -n 1)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for task in CustomVoice VoiceDesign Base; do
  PYTHONPATH="$ROOT" "$PYTHON" -m vllm_omni.testing qwen3_tts "$WORK/$task" --seed 0 --task-type "$task" >/dev/null
done
HF_HUB_OFFLINE=1 "$REF_PY" "$HERE/make_reference.py" "$WORK" "$HERE/fixtures"
