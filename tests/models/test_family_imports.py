"""A model family imports no other family: what two families share lives below them
(model_executor/models/*.py, layers/), so a family can change or go without breaking another."""
from __future__ import annotations

import ast
from pathlib import Path

import vllm_omni.model_executor.models as models

ROOT = Path(models.__file__).parent
FAMILY_DIRS = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and
                     "FAMILY = " in (p / "__init__.py").read_text(encoding="utf-8"))


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_families_import_no_other_family():
    assert len(FAMILY_DIRS) >= 4
    crossing = []
    for family in FAMILY_DIRS:
        others = {f"vllm_omni.model_executor.models.{f}" for f in FAMILY_DIRS if f != family}
        for path in sorted((ROOT / family).rglob("*.py")):
            for name in _imported(path):
                if any(name == o or name.startswith(o + ".") for o in others):
                    crossing.append(f"{family}/{path.relative_to(ROOT / family)} -> {name}")
    assert crossing == []


def test_shared_model_code_imports_no_family():
    """The modules beside the family folders are what families share: they import none of them
    (families.py, which lists the records, excepted)."""
    family_modules = tuple(f"vllm_omni.model_executor.models.{f}" for f in FAMILY_DIRS)
    found = [f"{path.name} -> {name}" for path in sorted(ROOT.glob("*.py")) if path.name != "families.py"
             for name in _imported(path) if name.startswith(family_modules)]
    assert found == []
