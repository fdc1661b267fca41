"""Parse-time checks of dotted names inside the `vllm_omni` package, without importing it.

Upstream configs name classes and functions of upstream's package (NPU workers, old scheduler
names, async-chunk bridges) under the same `vllm_omni.` prefix as ours. Importing to find out
pulls in torch and the models, so the config edge reads our source files instead: the module
file must exist and define (or import) the name at its top level. A name outside `vllm_omni`
is a user's plugin and is imported by resolve.validate_dotted_names.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = "vllm_omni"
_ROOT = Path(__file__).resolve().parents[1]  # the vllm_omni package folder

# Upstream worker classes of other accelerators: refused by name, with the reason.
_PLATFORM_WORKERS = {"npu": "Ascend NPU", "xpu": "Intel XPU", "hpu": "Intel Gaudi (HPU)", "rocm": "ROCm", "musa": "MUSA"}


def foreign_name_problem(name: str) -> str | None:
    """Why `name` (a dotted path under vllm_omni) does not exist here; None when it does, or
    when it is not under vllm_omni (a plugin)."""
    if not name.startswith(PACKAGE + "."):
        return None
    module, _, attr = name.rpartition(".")
    names = _top_level_names(module)
    if names is not None and attr in names:
        return None
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "worker" and parts[2] in _PLATFORM_WORKERS:
        return (f"{_PLATFORM_WORKERS[parts[2]]} worker classes are not supported: stages run on CUDA GPUs or the "
                "CPU (vllm_omni.worker.gpu_ar_worker.GPUARWorker, vllm_omni.worker.gpu_generation_worker."
                "GPUGenerationWorker)")
    if "diffusion" in name:
        return "diffusion stages are not supported yet"
    if names is None:
        return f"module {module!r} is not part of this vllm-omni"
    return f"module {module!r} has no {attr!r}"


@functools.lru_cache(maxsize=None)
def _top_level_names(module: str) -> frozenset[str] | None:
    rel = Path(*module.split(".")[1:])
    for path in (_ROOT / rel.with_suffix(".py"), _ROOT / rel / "__init__.py"):
        if path.is_file():
            return _defined_names(path)
    return None


def _defined_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)
