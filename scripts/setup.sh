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
# The installed torch's version from its metadata: importing torch before numpy is installed
# warns "Failed to initialize NumPy" (and takes seconds).
torch_version() { $VPY -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null; }
if ! torch_version >/dev/null; then
    $VPY -m pip install -q "torch==2.13.0"
fi
TORCH_VERSION=$(torch_version)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
# transformers is capped at the newest release the suite was run against: a new release has
# changed behaviour under us before (5.24 renamed the talker's cache argument).
printf 'torch==%s\ntorchvision<0\ntorchaudio<0\ntransformers<=5.24.0\n' "$TORCH_VERSION" > "$CONSTRAINTS"
# editable_mode=compat (a plain .pth path: spawned stage processes and pytest import the same
# tree, docs/install.md) makes setuptools print a banner that the mode is "transitional"; it works
# with every setuptools this project builds with, so the banner only alarms: filtered by its text.
PYTHONWARNINGS="ignore:Compat editable installs" \
    $VPY -m pip install -q -c "$CONSTRAINTS" -e ".[test]" --config-settings editable_mode=compat
