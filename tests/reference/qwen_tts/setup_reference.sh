#!/usr/bin/env bash
# Builds the reference environment for Qwen3-TTS: qwen-tts 0.1.1 pins transformers 4.57.3, so it
# cannot share the project venv. The venv is cached (default ~/.cache/vllm-omni/qwen_tts_ref) and
# this script is a no-op once it exists. Prints the venv's python path on its last line.
#
# qwen-tts imports torchaudio, sox and onnxruntime only for its 25 Hz tokenizer (not used by the
# 12 Hz models we compare with); torchaudio's registry wheels are CUDA builds that break CPU torch,
# so those three are replaced by stub modules that raise if anything actually calls them.
set -euo pipefail
CACHE="${VLLM_OMNI_REF_CACHE:-$HOME/.cache/vllm-omni}"
VENV="$CACHE/qwen_tts_ref"
PY="${PYTHON:-python3.11}"
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.complete" ]; then
  echo "$VENV/bin/python"; exit 0
fi
rm -rf "$VENV"
mkdir -p "$CACHE"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip >&2
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==2.13.0\ntorchvision<0\ntorchaudio<0\n' > "$CONSTRAINTS"
"$PIP" install -q torch==2.13.0 >&2
"$PIP" install -q -c "$CONSTRAINTS" qwen-tts==0.1.1 --no-deps >&2
"$PIP" install -q -c "$CONSTRAINTS" transformers==4.57.3 accelerate==1.12.0 librosa soundfile einops safetensors >&2

STUBS="$VENV/qwen_tts_stubs"
mkdir -p "$STUBS/torchaudio/compliance"
for mod in sox onnxruntime torchaudio torchaudio/compliance torchaudio/compliance/kaldi; do
  case "$mod" in
    sox|onnxruntime|torchaudio/compliance/kaldi) file="$STUBS/$mod.py" ;;
    *) file="$STUBS/$mod/__init__.py" ;;
  esac
  cat > "$file" <<'STUB'
"""Stub: only qwen-tts's 25 Hz tokenizer uses this module, and the reference never runs it."""
def __getattr__(name):
    raise ImportError(f"{__name__}.{name} is a stub in the qwen-tts reference venv")
STUB
done
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$STUBS" > "$SITE/qwen_tts_stubs.pth"
"$VENV/bin/python" -c "import qwen_tts, transformers; assert transformers.__version__ == '4.57.3'" >&2
touch "$VENV/.complete"
echo "$VENV/bin/python"
