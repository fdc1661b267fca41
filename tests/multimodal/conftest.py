"""The Qwen2.5-Omni input processor on the session's tiny checkpoint (tests/conftest.py
`omni_dir`), built once for the package: loading its tokenizer and feature extractors is the
slow part of these tests."""
import pytest


@pytest.fixture(scope="session")
def omni_processor(omni_dir):
    from vllm_omni.multimodal.qwen2_5_omni_processor import Qwen2_5OmniInputProcessor

    return Qwen2_5OmniInputProcessor.from_pretrained(omni_dir)
