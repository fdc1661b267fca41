"""Every tiny checkpoint a family record names is deterministic: the same seed gives the same
bytes in every file, another seed other weights (tests compare against references built from
them, and the demo model is rebuilt on each machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni.testing.tiny_models import make_tiny_model, tiny_checkpoint_builders

NAMES = sorted(tiny_checkpoint_builders())
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin")


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_bytes_other_seed_other_weights(tiny_model, tmp_path, name):
    first = files(tiny_model(name))
    again = files(make_tiny_model(name, tmp_path / "again"))
    assert first.keys() == again.keys()
    assert [f for f in first if first[f] != again[f]] == []
    other = files(make_tiny_model(name, tmp_path / "seed1", seed=1))
    weights = [f for f in first if f.endswith(WEIGHT_SUFFIXES)]
    assert weights and any(first[f] != other[f] for f in weights)
