import itertools
import textwrap
from pathlib import Path

import pytest

_ids = itertools.count()


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text, name="stages.yaml") -> Path of a dedented YAML file in tmp_path."""
    def write(text: str, name: str = "stages.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path
    return write


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """Create a uniquely named package of user plugin modules on sys.path.

    plugin_package({"sched": "class MyScheduler: ..."}) -> "pkgname"; modules are importable
    as pkgname.sched. The unique name keeps the resolver cache and sys.modules per test.
    """
    def make(modules: dict[str, str]) -> str:
        name = f"user_plugins_{next(_ids)}_{tmp_path.name.replace('-', '_')}"
        root = tmp_path / "plugins"
        pkg = root / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        for mod, src in modules.items():
            (pkg / f"{mod}.py").write_text(textwrap.dedent(src))
        monkeypatch.syspath_prepend(str(root))
        return name
    return make

