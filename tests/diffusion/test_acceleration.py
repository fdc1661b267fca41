"""The diffusion transformer's fast path: CompilableBlock against diffusers' block, and its settings.

On CUDA the Qwen-Image blocks run as CompilableBlock under torch.compile (tests/gpu compares the
compiled model with the eager one). Its math is checked here, uncompiled, in float32 on the CPU:
the same submodules in the same order with real-valued RoPE, GELU in the GEMM epilogue and
attention over each prompt length's valid tokens instead of a padding mask.
"""
from __future__ import annotations

import pytest
import torch

from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.diffusion.model import RowGroup
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.qwen_image import denoiser
from vllm_omni.model_executor.models.qwen_image.block import CompilableBlock, length_runs
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageRequest
from vllm_omni.worker.gpu_diffusion_worker import acceleration

# float32: the fused GELU (tanh form, computed inside addmm) rounds differently in the last bits.
TOLERANCE = 1e-4


def _prepared(model, prompt: str, negative: str, size: int = 64):
    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=4, true_cfg_scale=4.0, seed=0)
    req = StageRequest(request_id=prompt, prompt_token_ids=[], prompt=prompt, sampling_params=params,
                       additional_information={"negative_prompt": negative})
    return model.prepare(req, params)


def _batch(model, prepared: list, uncond: bool = True):
    groups = [RowGroup(p, p.latents, p.timesteps[1], False) for p in prepared]
    if uncond:
        groups += [RowGroup(p, p.latents, p.timesteps[1], True) for p in prepared]
    return model.make_batch(groups)


@pytest.mark.parametrize("prompts", [
    ["a red fox in the snow, photograph"],  # CFG: prompt and negative differ in length (a padded batch)
    ["a red fox in the snow, photograph", "two apples", "a city street in the rain, neon signs, cinematic"],
])
def test_compilable_block_equals_the_diffusers_block(t2i_model, prompts):
    prepared = [_prepared(t2i_model, p, " ") for p in prompts]
    emb = t2i_model.embed(_batch(t2i_model, prepared))
    assert emb.mask is not None and len(set(emb.text_lengths)) > 1
    wrapped = [CompilableBlock(block) for block in t2i_model.blocks]
    expected = denoiser.run_blocks(t2i_model.blocks, emb, None, compiled=False)
    got = denoiser.run_blocks(wrapped, emb, None, compiled=True)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    # A subset of rows (TeaCache computes only some): the same rows of the full result.
    rows = torch.tensor([0, len(prompts)])
    torch.testing.assert_close(denoiser.run_blocks(wrapped, emb, rows, compiled=True), expected[rows],
                               atol=TOLERANCE, rtol=0)


def test_compilable_block_without_padding(t2i_model):
    prepared = [_prepared(t2i_model, "two apples", " ")]
    emb = t2i_model.embed(_batch(t2i_model, prepared * 2, uncond=False))  # equal lengths: no mask
    assert emb.mask is None
    wrapped = [CompilableBlock(block) for block in t2i_model.blocks]
    torch.testing.assert_close(denoiser.run_blocks(wrapped, emb, None, compiled=True),
                               denoiser.run_blocks(t2i_model.blocks, emb, None, compiled=False),
                               atol=TOLERANCE, rtol=0)


def test_length_runs_group_consecutive_rows():
    assert length_runs([7, 7, 3, 7, 5, 5]) == [(0, 2, 7), (2, 3, 3), (3, 4, 7), (4, 6, 5)]
    assert length_runs([4]) == [(0, 1, 4)]


def test_compilation_follows_enforce_eager_and_the_device(qwen_image_dir):
    stage = load_pipeline_config(model=qwen_image_dir, platform="cuda").stage(0)
    accel = acceleration(stage.engine_args)
    assert accel.compile and accel.compile_dynamic  # the bundled config compiles
    assert accel.compiles(torch.device("cuda")) and not accel.compiles(torch.device("cpu"))
    eager = load_pipeline_config(model=qwen_image_dir, platform="cuda", cli_args={"enforce_eager": True}).stage(0)
    assert not acceleration(eager.engine_args).compile
    assert accel.describe(torch.device("cuda")) == {"attention_backend": "CUDNN_ATTN", "compile": "dynamic"}
    assert accel.describe(torch.device("cpu")) == {"attention_backend": "TORCH_SDPA", "compile": "off"}


def test_a_cpu_model_keeps_the_diffusers_blocks(qwen_image_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    model = QwenImageModel.load(qwen_image_dir, device=torch.device("cpu"), dtype=torch.float32,
                                acceleration=DenoiserAcceleration(compile=True))
    assert not model.compiled and model.blocks is model.c.transformer.transformer_blocks
    assert model.describe()["compile"] == "off"


def test_attention_backends(qwen_image_dir):
    stage = load_pipeline_config(model=qwen_image_dir, platform="cuda",
                                 cli_args={"diffusion_attention_backend": "torch_sdpa"}).stage(0)
    assert stage.engine_args.diffusion_attention_backend == "TORCH_SDPA"
    for name, match in (("SAGE_ATTN", "SageAttention is not a dependency"), ("NOPE", "TORCH_SDPA | CUDNN_ATTN")):
        with pytest.raises(ConfigError, match=match):
            load_pipeline_config(model=qwen_image_dir, platform="cuda", cli_args={"diffusion_attention_backend": name})
    with pytest.raises(ConfigError, match="'regional'"):
        load_pipeline_config(model=qwen_image_dir, platform="cuda",
                             cli_args={"diffusion_compile_granularity": "full"})
    with pytest.raises(ValueError, match="SAGE_ATTN"):
        DenoiserAcceleration(attention_backend="SAGE_ATTN")
