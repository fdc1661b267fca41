"""A script must build `Omni` / `AsyncOmni` under `if __name__ == "__main__":`; say so at once.

Stage processes are started with multiprocessing's spawn (CUDA cannot be forked), and a spawned
child first runs the parent's main module again (as `__mp_main__`) to find its functions. A script
that builds Omni at module level would build it again in every stage process, each child would
fail while starting, and the stages would be restarted until the pipeline gave up, tens of
seconds later. So before any stage starts, the parent looks at the main script: when the
module-level statement that is running now (the one that, directly or through calls, builds this
Omni) is not inside an `if` on `__name__`, it refuses with what to add. A child that gets this far
anyway (the parent could not read its script) refuses too, with the same words.
"""
from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from types import FrameType

GUARD_HINT = ('put the code that builds and uses {what} under `if __name__ == "__main__":` (stage processes are '
              "started with multiprocessing's spawn, which runs the main module's top-level code again in each "
              "of them; see https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods)")


def check_main_module_guarded(what: str) -> None:
    """RuntimeError when the main script builds `what` (e.g. "Omni") outside a `__name__` guard."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a spawned child importing main
        raise RuntimeError(f"{what} was built while a stage process re-ran the main module: "
                           + GUARD_HINT.format(what=what))
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or not _rerun_by_spawn(main, path):
        return
    frame = _main_module_frame(vars(main))
    if frame is None:
        return
    line = frame.f_lineno
    if _is_guarded(path, line) is False:
        raise RuntimeError(f"{path}, line {line} builds {what} at module level: " + GUARD_HINT.format(what=what))


def _rerun_by_spawn(main, path: str) -> bool:
    """Whether a spawned child runs this main module again (as multiprocessing.spawn decides):
    not an interactive session or `python -c` (no file), nor a package's `__main__` module run
    with -m, nor IPython."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    return os.path.splitext(os.path.basename(path))[0] != "ipython"


def _main_module_frame(main_globals: dict) -> FrameType | None:
    """The frame running the main script's top-level code, if it is on the stack."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            found = frame
        frame = frame.f_back
    return found


def _is_guarded(path: str, line: int) -> bool | None:
    """Whether `line` of the script is guarded (None: it cannot be read or parsed, so nobody can tell)."""
    try:
        with open(path, encoding="utf-8") as f:
            return line_is_guarded(f.read(), line)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def line_is_guarded(source: str, line: int) -> bool:
    """Whether `line` of a module's source lies inside an `if` whose test reads `__name__`."""
    body: list[ast.stmt] = ast.parse(source).body
    while True:
        stmt = next((s for s in body if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
        if stmt is None:
            return False
        if isinstance(stmt, ast.If) and any(isinstance(n, ast.Name) and n.id == "__name__"
                                            for n in ast.walk(stmt.test)):
            return True
        body = [b for field in ("body", "orelse", "finalbody") for b in getattr(stmt, field, [])]
        body += [b for handler in getattr(stmt, "handlers", []) for b in handler.body]
