"""Every registered model class imports in a fresh interpreter (stage processes import
exactly one of them first, so an import cycle that another order hides breaks a stage).

One interpreter imports torch and transformers (third-party, no part of a cycle of ours), then
forks a child per class: each child starts with no vllm_omni module loaded, as a fresh
interpreter does, without paying for torch's import twelve times."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_omni.model_executor.models.families import FAMILIES

ENTRIES = sorted({tuple(path.split(":")) for f in FAMILIES
                  for path in (*f.stage_models.values(), *filter(None, [f.single_stage_model]))})

# Runs in a fresh interpreter: {"module:cls": "" when the import worked, else the traceback's tail}.
FORK_EACH = """
import json, os, sys, traceback
import torch, transformers
assert not [m for m in sys.modules if m.split(".")[0] == "vllm_omni"]
results = {}
for module, cls in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            import importlib
            getattr(importlib.import_module(module), cls)
            error = ""
        except BaseException:
            error = traceback.format_exc()[-2000:]
        os.write(write, error.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        error = f.read().decode()
    _, status = os.waitpid(pid, 0)
    results[f"{module}:{cls}"] = error or ("" if status == 0 else f"the child exited with status {status}")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, str]:
    result = subprocess.run([sys.executable, "-c", FORK_EACH, json.dumps(ENTRIES)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module,cls", ENTRIES, ids=[f"{m.rsplit('.', 1)[-1]}.{c}" for m, c in ENTRIES])
def test_model_class_imports_alone(imported_alone, module, cls):
    assert imported_alone[f"{module}:{cls}"] == ""
