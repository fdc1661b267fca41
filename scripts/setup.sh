#!/usr/bin/env bash
# Creates ./.venv with CPU torch and the package installed (editable). Idempotent.
# torch is installed first and pinned through a constraints file, so no later
# requirement can pull a CUDA build, torchvision or torchaudio (see docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip >/dev/null
if ! $VPY -c "import torch" 2>/dev/null; then
    $VPY -m pip install -q "torch==2.13.0"
fi
TORCH_VERSION=$($VPY -c "import torch; print(torch.__version__)")
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
# transformers is capped at the newest release the suite was run against: a new release has
# changed behaviour under us before (5.24 renamed the talker's cache argument).
printf 'torch==%s\ntorchvision<0\ntorchaudio<0\ntransformers<=5.24.0\n' "$TORCH_VERSION" > "$CONSTRAINTS"
$VPY -m pip install -q -c "$CONSTRAINTS" -e ".[test]" --config-settings editable_mode=compat
