"""Every registered model class imports in a fresh interpreter (stage processes import
exactly one of them first, so an import cycle that another order hides breaks a stage)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_omni.model_executor.models.families import FAMILIES

ENTRIES = sorted({tuple(path.split(":")) for f in FAMILIES
                  for path in (*f.stage_models.values(), *filter(None, [f.single_stage_model]))})


@pytest.mark.parametrize("module,cls", ENTRIES, ids=[f"{m.rsplit('.', 1)[-1]}.{c}" for m, c in ENTRIES])
def test_model_class_imports_alone(module, cls):
    code = f"import importlib; getattr(importlib.import_module({module!r}), {cls!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
