import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text, name="stages.yaml") -> Path of a dedented YAML file in tmp_path."""
    def write(text: str, name: str = "stages.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write
