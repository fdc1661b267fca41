"""The README's and the docs' Python examples as a user copies them into a file: each compiles, each
builds `Omni` / `AsyncOmni` under `if __name__ == "__main__":`, and the README's Omni example runs
with `python file.py` on the demo model. A script that builds Omni without the guard (stage
processes are spawned, and spawn re-runs the main script) stops at once, saying what to add."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_omni.entrypoints.main_guard import check_main_module_guarded, line_is_guarded

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PIPELINES = {"Omni", "AsyncOmni"}


def python_examples(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def pipelines_built(source: str) -> list[int]:
    """Lines that call Omni(...) / AsyncOmni(...)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PIPELINES]


def test_every_example_compiles_and_guards_the_pipelines_it_builds():
    examples = {(path.name, i): code for path in DOCS for i, code in enumerate(python_examples(path))}
    assert len(examples) >= 8 and any(pipelines_built(code) for code in examples.values())
    for where, code in examples.items():
        compile(code, f"{where}", "exec")
        assert all(line_is_guarded(code, line) for line in pipelines_built(code)), where


def test_the_readme_omni_example_runs_as_a_file(tmp_path):
    [example] = [code for code in python_examples(REPO / "README.md") if pipelines_built(code)]
    script = tmp_path / "omni_example.py"
    script.write_text(example)
    # The demo model lives in the user's cache, as for `vllm-omni serve` with no MODEL.
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text, shape = run.stdout.strip().splitlines()[-2:]
    assert len(text.split()) > 3 and re.fullmatch(r"torch\.Size\(\[\d+\]\)", shape), run.stdout


UNGUARDED = {
    "at module level": "omni = Omni(model={model!r})\n",
    "in a function called at module level": "def main():\n    Omni(model={model!r})\n\n\nmain()\n",
}


@pytest.mark.parametrize("shape", UNGUARDED)
def test_an_unguarded_script_stops_before_any_stage_starts(tmp_path, shape):
    model = tmp_path / "model"
    model.mkdir()  # a config alone: the check comes before anything loads weights
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni",
                                                   "architectures": ["Qwen2_5OmniForConditionalGeneration"]}))
    script = tmp_path / "unguarded.py"
    script.write_text("from vllm_omni import Omni\n\n" + UNGUARDED[shape].format(model=str(model)))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {script}, line ") and 'if __name__ == "__main__":' in last
    # Nothing else happened first: no stage was started (or restarted), nothing logged.
    assert run.stderr.startswith("Traceback") and run.stdout == ""


@pytest.mark.parametrize(("source", "line", "guarded"), [
    ("x = 1\nif __name__ == '__main__':\n    y = 2\n", 3, True),
    ("x = 1\nif __name__ == '__main__':\n    y = 2\n", 1, False),
    ("try:\n    if '__main__' == __name__ and True:\n        with open('f') as f:\n            y = 2\n"
     "except OSError:\n    pass\n", 4, True),
    ("if True:\n    y = 2\n", 2, False),
    ("class A:\n    y = 2\n", 2, False),
])
def test_line_is_guarded(source, line, guarded):
    assert line_is_guarded(textwrap.dedent(source), line) is guarded


def test_a_spawned_child_re_running_main_refuses(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match="re-ran the main module"):
        check_main_module_guarded("Omni")
