"""`--diffusion-attention-config` (per role, JSON or dotted flags) and `--diffusion-kv-cache-dtype fp8`
with its skip selectors: parsing, refusals by name, and what a generation really quantizes."""
from __future__ import annotations

import pytest
import torch

from tests.diffusion.conftest import Case, WanCase, image_of, run_engine, video_of
from tests.diffusion.test_tea_cache import psnr
from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.entrypoints.cli import serve_args
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings, DiffusionAttentionConfig, parse_selector
from vllm_omni.model_executor.models.diffusion_attention import fp8_per_head

QWEN_IMAGE = {"architectures": ["QwenImagePipeline"]}


def test_selectors():
    assert parse_selector("0-9,20,25-27", "s") == (*range(10), 20, 25, 26, 27)
    assert parse_selector(" 3 , 1", "s") == (1, 3) and parse_selector([4, 2, 4], "s") == (2, 4)
    for bad, match in (("1-", "not an index"), ("a", "not an index"), ("5-2", "runs backwards"), ("-1", "not an index"),
                       ("", "expected a selector"), ([1, -1], "expected a selector"), (3, "expected a selector")):
        with pytest.raises(ValueError, match=match):
            parse_selector(bad, "skip")


def test_bad_selectors_are_refused_at_the_config_edge():
    with pytest.raises(ConfigError, match="diffusion_kv_cache_skip_steps.*'2-x'.*not an index"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
            "diffusion_kv_cache_dtype": "fp8", "diffusion_kv_cache_skip_steps": "0,2-x"})
    with pytest.raises(ConfigError, match="diffusion_kv_cache_dtype fp8 skips, and it is not set"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={"diffusion_kv_cache_skip_layers": "0"})
    with pytest.raises(ConfigError, match="null or \"fp8\""):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={"diffusion_kv_cache_dtype": "int8"})


def test_roles_resolve_exact_then_category_then_default():
    config = DiffusionAttentionConfig.parse({"default": {"backend": "CUDNN_ATTN", "quant": {"method": "fp8"}},
                                             "per_role": {"self": {"backend": "FLASH_ATTN"},
                                                          "cross": {"quant": {"method": "float"}}}})
    joint, cross = config.spec_for("joint", "self"), config.spec_for("cross", "cross")
    assert (joint.backend, joint.quant.method) == ("FLASH_ATTN", "fp8")  # category self, default's quant
    assert (cross.backend, cross.quant.method) == ("CUDNN_ATTN", "float")


@pytest.mark.parametrize("value, match", [
    ({"per_role": {"self": {"backend": "SAGE_ATTN"}}}, "SAGE_ATTN is not available \\(SageAttention"),
    ({"default": {"quant": {"method": "mxfp8"}}}, "'mxfp8' is not supported \\(MXFP8 attention is an Ascend"),
    ({"default": {"quant": {"method": "fp8", "rotation_seed": 1}}}, "rotated \\(Hadamard\\)"),
    ({"default": {"skip_softmax": {"target_sparsity": 0.5}}}, "TRTLLM_ATTN's setting"),
    ({"default": {"quant": {"method": "fp8", "fallback": ["float", "fp8"]}}}, "repeats a method"),
    ({"per_role": {"self": {"backend": "TORCH_SDPA", "window": 3}}}, "unknown key 'window'"),
    ({"roles": {}}, "expected")])
def test_what_is_not_here_is_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        DiffusionAttentionConfig.parse(value)


def test_dotted_flags_fold_into_the_json_and_reach_the_stage():
    argv = serve_args.fold_dotted_flags([
        "model", "--diffusion-attention-config", '{"per_role": {"cross": {"backend": "TORCH_SDPA"}}}',
        "--diffusion-attention-config.per_role.self.backend", "FLASH_ATTN",
        "-dac.per_role.self.quant.method=fp8", "--diffusion-attention-config.per_role.self.quant.skip_steps", "0-1"])
    parser = __import__("argparse").ArgumentParser()
    serve_args.add_arguments(parser)
    args = parser.parse_args(argv)
    assert args.diffusion_attention_config == {"per_role": {"cross": {"backend": "TORCH_SDPA"}, "self": {
        "backend": "FLASH_ATTN", "quant": {"method": "fp8", "skip_steps": "0-1"}}}}
    assert serve_args.refused_flags(args) == []
    config = load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args=serve_args.engine_args(args)) \
        .stage(0).engine_args.diffusion_attention_config
    assert config.spec_for("self", "self").quant.skip_steps == (0, 1)


def test_conflicting_attention_settings_are_refused():
    with pytest.raises(ConfigError, match="default.backend and diffusion_attention_backend"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
            "diffusion_attention_backend": "TORCH_SDPA",
            "diffusion_attention_config": {"default": {"backend": "CUDNN_ATTN"}}})
    with pytest.raises(ConfigError, match="quant.method 'float' contradicts diffusion_kv_cache_dtype 'fp8'"):
        load_pipeline_config(model=QWEN_IMAGE, platform="cpu", cli_args={
            "diffusion_kv_cache_dtype": "fp8",
            "diffusion_attention_config": {"per_role": {"self": {"quant": {"method": "float"}}}}})


def test_fp8_per_head_quantization():
    x = torch.randn(2, 3, 5, 8) * torch.tensor([0.01, 1.0, 100.0]).view(1, 3, 1, 1)
    q = fp8_per_head(x)
    assert not torch.equal(q, x) and ((q - x).abs() <= 2 ** -4 * x.abs() + 1e-12).all()  # one scale per (row, head)


def test_a_role_the_model_lacks_is_refused(qwen_image_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    accel = DenoiserAcceleration(attention=AttentionSettings(DiffusionAttentionConfig.parse(
        {"per_role": {"cross": {"backend": "TORCH_SDPA"}}})))
    with pytest.raises(ValueError, match="per_role.cross: Qwen-Image has no such attention; its roles: joint "
                                         "\\(category self\\)"):
        QwenImageModel(_components(qwen_image_dir), device=torch.device("cpu"), acceleration=accel)


def _components(path):
    from vllm_omni.model_executor.models.qwen_image.components import load_components

    return load_components(path, device=torch.device("cpu"), dtype=torch.float32)


def test_fp8_kv_skips_the_selected_steps_and_layers(qwen_image_dir, make_engine, monkeypatch):
    """Two layers, 4 steps, CFG (2 rows): layer 0 skipped, steps 0 and 1 skipped: only layer 1 in
    steps 2 and 3 quantizes (2 rows each); the image moves a little. (PyTorch's flash kernel.)"""
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    config = DiffusionAttentionConfig.parse({"per_role": {"self": {"backend": "FLASH_ATTN"}}})  # joint's category
    settings = AttentionSettings(config, kv_cache_dtype="fp8", kv_skip_steps=(0, 1), kv_skip_layers=(0,))
    model = QwenImageModel(_components(qwen_image_dir), device=torch.device("cpu"),
                           acceleration=DenoiserAcceleration(attention=settings))
    assert model.own_blocks and len(model.blocks) == 2 and {b.site.backend for b in model.blocks} == {"FLASH_ATTN"}
    case = Case("k", "a red fox", negative="blurry", params=dict(height=64, width=64, num_inference_steps=4, seed=2))
    from vllm_omni.model_executor.models import diffusion_attention

    calls = []  # the quantizer seen from outside: one call for K, one for V, per quantizing forward
    real = diffusion_attention.fp8_per_head
    monkeypatch.setattr(diffusion_attention, "fp8_per_head", lambda x, *more: calls.append(x.shape[0]) or real(x, *more))
    quantized = image_of(run_engine(make_engine(model), [case])["k"])
    assert calls == [2] * 4  # layer 1 in steps 2 and 3, K and V of both CFG rows
    stats = model.blocks[0].site.stats
    assert dict(stats) == {("joint", 1): 4}
    exact = image_of(run_engine(make_engine(), [case])["k"])
    assert 30.0 <= psnr(quantized, exact) < float("inf")


def test_wan_with_fp8_weights_fp8_self_attention_and_cache_dit(wan_dir, wan_model):
    """Wan2.2 A14B with FP8 weights on both experts, per-role attention (self-attention FP8 K/V,
    layer indices per transformer, steps over the whole request; cross-attention float on
    TORCH_SDPA) and DBCache on a fixed schedule (its steps counted per expert, as cache-dit's one
    context per transformer): what runs where, and the video within a bounded PSNR of float32's."""
    from vllm_omni.model_executor.layers.fp8_linear import Fp8Linear
    from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
    from vllm_omni.diffusion.db_cache import DBCache, DBCacheConfig
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    config = DiffusionAttentionConfig.parse({"per_role": {"self": {"quant": {"method": "fp8", "skip_steps": "3"}},
                                                          "cross": {"backend": "TORCH_SDPA"}}})
    accel = DenoiserAcceleration(attention=AttentionSettings(config), quantization=DiffusionQuantization("fp8"))
    model = WanModel.load(wan_dir("a14b"), device=torch.device("cpu"), dtype=torch.float32, acceleration=accel)
    assert all(isinstance(t.blocks[0].attn1.to_q, Fp8Linear) for t in model.c.transformers)  # both experts
    case = WanCase("w", "a red fox running", params=dict(height=32, width=48, num_frames=5, num_inference_steps=4,
                                                         guidance_scale=1.0, seed=5))
    cache = DBCache(DBCacheConfig(max_warmup_steps=1, steps_computation_mask=(1, 0), steps_computation_policy="static"))
    video = video_of(run_engine(DiffusionEngine(model, stage_id=0, max_batch_size=2, cache=cache), [case])["w"])
    high, low = (dict(blocks[0].self_site.stats) for blocks in model.blocks)
    # Steps 0, 1 on the high-noise expert, 2, 3 on the low-noise one; 2 layers each. Each expert's
    # second step reuses its cached layer 1 (the mask); step 3 skips FP8 K/V.
    assert high == {("self", 0): 2, ("self", 1): 1} and low == {("self", 0): 1, ("self", 1): 1}
    assert (cache.computed, cache.skipped) == (2, 2)
    exact = video_of(run_engine(DiffusionEngine(wan_model("a14b"), stage_id=0, max_batch_size=2), [case])["w"])
    quality = psnr(video, exact)
    print(f"\nWan FP8 weights + FP8 self-attention K/V + DBCache (half the steps reused): {quality:.1f} dB PSNR")
    assert not torch.equal(video, exact) and quality >= 20.0
