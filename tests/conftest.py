import os

# Nothing can be downloaded: make any accidental hub lookup fail fast.
os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(arch, seed=0, **overrides) -> Path`, built once per distinct call.

    The folder is shared by every test in the session: copy it before changing files in it.
    """
    from vllm_omni.testing.tiny_models import make_tiny_model

    built: dict[tuple, Path] = {}

    def build(arch: str, seed: int = 0, **overrides) -> Path:
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-s{seed}")
            built[key] = make_tiny_model(arch, out, seed=seed, **overrides)
        return built[key]

    return build
