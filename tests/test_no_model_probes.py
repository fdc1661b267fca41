"""The runtime never probes a model: models declare what they do on their base classes
(StageModel, GenerationModel, DiffusionModel) and the runtime reads those attributes and calls
those hooks (docs/architecture.md, "Three seams")."""
from __future__ import annotations

import ast
from pathlib import Path

import vllm_omni

ROOT = Path(vllm_omni.__file__).parent
RUNTIME = ("worker", "engine", "core", "diffusion", "entrypoints")


def _probes(path: Path) -> list[str]:
    """`getattr(x, ...)` / `hasattr(x, ...)` where x names a model (model, self.model, model_cls...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "model" in target.lower():
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_runtime_folders_do_not_probe_models():
    probes = [p for folder in RUNTIME for path in sorted((ROOT / folder).rglob("*.py")) for p in _probes(path)]
    assert probes == []


def test_entrypoints_name_no_model_family():
    """What a model can do is its family record's answer (e.g. `speaks_from_text`), never a
    comparison with a family's name, model_type or architecture in the entry points."""
    from vllm_omni.model_executor.models.families import FAMILIES

    names = {n for f in FAMILIES for n in (f.name, *f.model_types, *f.architectures, *f.stage_checkpoints)}
    found = []
    for path in sorted((ROOT / "entrypoints").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    assert found == []
