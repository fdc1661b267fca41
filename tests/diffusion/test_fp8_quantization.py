"""FP8 weights (`--diffusion-quantization-config '{"method": "fp8"}'`, `--force-cutlass-fp8`): the
linear layer's math against float32, and a whole tiny Qwen-Image generation against the unquantized
one (Wan2.2's, with FP8 weights and FP8 attention together: test_diffusion_attention.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.diffusion.conftest import Case, image_of, run_engine
from tests.diffusion.test_tea_cache import psnr
from vllm_omni.model_executor.layers.fp8_linear import FP8_DTYPE, Fp8Linear, quantize_linears
from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization

FP8 = DiffusionQuantization("fp8")
# e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of itself (half an ulp),
# so each product x_i w_i by at most (2 * 2^-4 + 2^-8) of |x_i w_i|.
FP8_PRODUCT_BOUND = 2 * 2 ** -4 + 2 ** -8


def test_fp8_linear_against_float32_within_the_fp8_error_bound():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 1, 64)  # channels of very different magnitudes
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (48,)
    assert torch.equal(layer.weight_scale, linear.weight.abs().amax(1) / 448)  # absmax per output channel
    got, exact = layer(x), linear(x)
    bound = FP8_PRODUCT_BOUND * (x.abs() @ linear.weight.abs().t()) + 1e-6
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 1e-4  # it does quantize


def test_the_reference_path_computes_the_quantized_operands_product():
    """What the CPU computes is (q(x) s_x)(q(W) s_W)^T: the operands torch._scaled_mm gets."""
    torch.manual_seed(1)
    linear = nn.Linear(32, 16, bias=False)
    x = torch.randn(7, 32)
    layer = Fp8Linear.from_linear(linear)
    x_scale = x.abs().amax(1, keepdim=True) / 448
    xq = (x / x_scale).to(FP8_DTYPE).float() * x_scale
    torch.testing.assert_close(layer(x), xq @ layer.dequantized_weight().t(), rtol=1e-6, atol=1e-6)


def test_quantize_linears_replaces_every_linear_but_the_ignored():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    assert quantize_linears(model, use_scaled_mm=False, skip=lambda name: name == "2.1") == 2
    assert [type(m).__name__ for m in (model[0], model[2][0], model[2][1])] == ["Fp8Linear", "Fp8Linear", "Linear"]


@pytest.mark.parametrize("value, match", [
    ({"method": "int8"}, "'int8' is not supported"), ({"method": "mxfp4"}, "Blackwell or Ascend"),
    ({"method": "fp8", "activation_scheme": "static"}, "calibrated checkpoint"),
    ({"method": "fp8", "group_size": 128}, "unknown key"), ({"method": "gguf"}, "gguf_model"), ("fp8", "JSON object")])
def test_bad_quantization_configs_are_refused_with_the_reason(value, match):
    with pytest.raises(ValueError, match=match):
        DiffusionQuantization.parse(value)


def test_force_cutlass_fp8_is_refused_where_the_fp8_gemm_cannot_run(qwen_image_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    with pytest.raises(ValueError, match="--force-cutlass-fp8: FP8 GEMMs need a CUDA GPU"):
        QwenImageModel.load(qwen_image_dir, device=torch.device("cpu"), dtype=torch.float32,
                            acceleration=DenoiserAcceleration(quantization=FP8, force_cutlass_fp8=True))


def test_force_cutlass_fp8_without_fp8_weights_is_refused(t2i_model):
    from vllm_omni.model_executor.models.diffusion_quantization import check_force_cutlass

    with pytest.raises(ValueError, match="applies to FP8 weights"):
        check_force_cutlass([t2i_model.c.transformer.transformer_blocks], True)


@pytest.fixture(scope="module")
def fp8_t2i_model(qwen_image_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    return QwenImageModel.load(qwen_image_dir, device=torch.device("cpu"), dtype=torch.float32,
                               acceleration=DenoiserAcceleration(quantization=FP8))


def test_qwen_image_generates_with_fp8_weights_close_to_float32(fp8_t2i_model, make_engine):
    info = fp8_t2i_model.describe()
    blocks = fp8_t2i_model.c.transformer.transformer_blocks
    assert info["quantization"] == "fp8" and info["fp8_layers"] == sum(isinstance(m, Fp8Linear) for m in blocks.modules())
    assert not any(isinstance(m, nn.Linear) for m in blocks.modules())  # every block linear is FP8
    case = Case("q", "a red fox in the snow", params=dict(height=64, width=64, num_inference_steps=4, seed=3))
    exact = image_of(run_engine(make_engine(), [case])["q"])
    fp8 = image_of(run_engine(make_engine(fp8_t2i_model), [case])["q"])
    quality = psnr(fp8, exact)
    print(f"\nFP8 weights vs float32: {quality:.1f} dB PSNR (two seeds of the tiny model: ~20 dB)")
    assert not torch.equal(fp8, exact)
    assert quality >= 35.0
