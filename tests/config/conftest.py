"""User plugin packages for the config tests (`plugin_package`); YAML files come from the root
conftest's `write_yaml`."""
import itertools
import textwrap

import pytest

_ids = itertools.count()


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

