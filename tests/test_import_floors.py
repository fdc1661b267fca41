"""The package's imports run one way (docs/architecture.md, "Floors").

Every `import vllm_omni...` in the package, at module level or inside a function, is an edge.
A module may import from its own floor or a lower one, never a higher one, and the graph of
folders (packages) has no cycle.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import vllm_omni

ROOT = Path(vllm_omni.__file__).parent

# Lowest first. A top-level module or folder of vllm_omni belongs to exactly one floor.
FLOORS: list[set[str]] = [
    {"stage_io", "sampling_params", "outputs", "inputs", "imports", "logging_filters", "version", "growing_tensor", "playback",
     "deploy"},  # the vocabulary (and the bundled deploy YAMLs)
    {"model_executor"},  # layers, models, family records, bridges
    {"multimodal"},  # prompt and media processing (reads model files: speakers, templates)
    {"config"},  # stage configs; finds bundled pipelines through the family records
    {"core", "diffusion"},  # the AR engine; the diffusion engine
    {"worker"},  # what a stage process drives
    {"engine"},  # the multi-stage runtime
    {"testing"},  # tiny checkpoints, the demo model
    {"entrypoints"},  # Omni, AsyncOmni, LLM, CLI, server
    {"__init__"},  # the public API (imports entrypoints lazily)
]
FLOOR_OF = {name: i for i, floor in enumerate(FLOORS) for name in floor}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            # `from vllm_omni.x import y` may name a submodule y: count it too when it exists.
            found.update(f"{name}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] == "vllm_omni"}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, name) if m in modules}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _folder(module: str, graph: dict[str, set[str]]) -> str:
    # A package's own __init__ is in its folder; any other module in its parent's.
    is_package = any(other.startswith(module + ".") for other in graph)
    return module if is_package else module.rpartition(".")[0]


def test_every_top_level_part_has_a_floor():
    tops = {_top(m) for m in _graph()}
    assert tops <= set(FLOOR_OF), f"give these a floor in FLOORS: {sorted(tops - set(FLOOR_OF))}"


def test_no_upward_imports():
    upward = sorted(
        f"{src} -> {dst}"
        for src, dsts in _graph().items()
        for dst in dsts
        if FLOOR_OF[_top(dst)] > FLOOR_OF[_top(src)]
    )
    assert not upward, "imports that go up a floor:\n" + "\n".join(upward)


def test_no_cycles_between_folders():
    graph = _graph()
    folders: dict[str, set[str]] = defaultdict(set)
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = _folder(src, graph), _folder(dst, graph)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                folders[a].add(b)
    # Depth-first search for a back edge.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(folders.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for folder in sorted(folders):
        if folder not in state and (cycle := visit(folder)):
            raise AssertionError("folders import each other: " + " -> ".join(cycle))
