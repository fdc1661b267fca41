"""`--auxiliary-text-encoder`: a pipeline with a Llama text encoder slot (HiDream-I1's text_encoder_4)
gets it; the native pipelines (Qwen-Image, Wan2.2) and adapter pipelines without one refuse it."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.config import load_pipeline_config


def test_the_native_pipelines_refuse_it(qwen_image_dir):
    from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

    stage = load_pipeline_config(model=qwen_image_dir, platform="cpu",
                                 cli_args={"auxiliary_text_encoder": "meta-llama/Llama-3.1-8B-Instruct"}).stage(0)
    assert stage.engine_args.auxiliary_text_encoder == "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(ValueError, match="the native pipelines \\(Qwen-Image, Wan2.2\\) take no auxiliary text encoder"):
        GPUDiffusionWorker(stage, str(qwen_image_dir), device="cpu").build_engine()


def test_an_adapter_pipeline_without_the_slot_refuses_it(qwen_image_dir):
    import diffusers

    from vllm_omni.diffusion.diffusers_engine import auxiliary_text_encoder

    with pytest.raises(ValueError, match="QwenImagePipeline takes no auxiliary text encoder"):
        auxiliary_text_encoder(str(qwen_image_dir), diffusers.DiffusionPipeline, "llama", torch.float32)
    assert auxiliary_text_encoder(str(qwen_image_dir), diffusers.DiffusionPipeline, None, torch.float32) == {}


def test_hidream_gets_the_llama_encoder_and_tokenizer(tmp_path):
    from diffusers import HiDreamImagePipeline
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_omni.diffusion.diffusers_engine import auxiliary_text_encoder
    from vllm_omni.testing.tokenizer import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    parts = auxiliary_text_encoder("unused", HiDreamImagePipeline, str(tmp_path), torch.float32)
    assert set(parts) == {"text_encoder_4", "tokenizer_4"}
    encoder = parts["text_encoder_4"]
    assert isinstance(encoder, LlamaForCausalLM) and encoder.config.output_hidden_states  # what HiDream reads
    assert parts["tokenizer_4"]("a fox").input_ids == tokenizer("a fox").input_ids
