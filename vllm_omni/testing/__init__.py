"""Test fixtures that are also product features: tiny random checkpoints, the demo model."""
from vllm_omni.testing.tiny_models import demo_model_path, make_tiny_model
from vllm_omni.testing.tokenizer import make_tiny_tokenizer

__all__ = ["demo_model_path", "make_tiny_model", "make_tiny_tokenizer"]
