import pytest


@pytest.fixture(scope="session")
def omni_dir(tiny_model):
    return tiny_model("qwen2_5_omni")


@pytest.fixture(scope="session")
def omni_processor(omni_dir):
    from vllm_omni.multimodal.qwen2_5_omni_processor import Qwen2_5OmniInputProcessor

    return Qwen2_5OmniInputProcessor.from_pretrained(omni_dir)
