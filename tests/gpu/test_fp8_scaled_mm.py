"""FP8 weights on the GPU: torch._scaled_mm (per-token x per-channel scales) against the dequantized
reference path the CPU runs, and a stage that --force-cutlass-fp8 accepts. Needs a CUDA GPU with
FP8 tensor cores (compute capability 8.9+)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_omni.model_executor.layers.fp8_linear import Fp8Linear, fp8_gemm_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or fp8_gemm_problem(torch.device("cuda")) is not None,
                                reason="needs a CUDA GPU with FP8 GEMMs (compute capability 8.9+)")


@pytest.mark.parametrize("rows, k, n", [(1, 3072, 18432), (77, 3072, 3072), (4096, 3072, 12288), (300, 12288, 3072)])
def test_scaled_mm_equals_the_reference_path(rows, k, n):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-1, 1, k, device="cuda").bfloat16()
    fast = Fp8Linear.from_linear(linear, use_scaled_mm=True)
    reference = Fp8Linear(fast.weight, fast.weight_scale, fast.bias, use_scaled_mm=False)
    assert fast.use_scaled_mm and not reference.use_scaled_mm
    got, expected = fast(x).float(), reference(x).float()
    # The same fp8 operands; the GEMM sums in float32 in another order and rounds to bf16 once.
    scale = expected.abs().mean()
    assert (got - expected).abs().max() <= 2e-2 * scale + 8e-3 * expected.abs().max()
    exact = linear(x).float()
    assert (got - exact).abs().mean() <= 0.05 * exact.abs().mean()  # and FP8 stays near bf16


def test_static_input_scale_on_scaled_mm():
    torch.manual_seed(1)
    linear = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    fast = Fp8Linear.from_linear(linear, use_scaled_mm=True)
    static = torch.tensor(float(x.abs().max()) / 448, device="cuda")
    a = Fp8Linear(fast.weight, fast.weight_scale, fast.bias, input_scale=static, use_scaled_mm=True)(x).float()
    b = Fp8Linear(fast.weight, fast.weight_scale, fast.bias, input_scale=static, use_scaled_mm=False)(x).float()
    assert (a - b).abs().max() <= 2e-2 * b.abs().mean() + 8e-3 * b.abs().max()


def test_a_bf16_stage_runs_its_fp8_layers_on_scaled_mm_and_accepts_force_cutlass(tiny_model):
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    model = QwenImageModel.load(tiny_model("qwen_image"), device=torch.device("cuda"), dtype=torch.bfloat16,
                                acceleration=DenoiserAcceleration(quantization=DiffusionQuantization("fp8"),
                                                                  force_cutlass_fp8=True))
    info = model.describe()
    assert info["fp8_layers"] == info["fp8_scaled_mm_layers"] > 0
    with pytest.raises(ValueError, match="--force-cutlass-fp8: the FP8 GEMM takes bfloat16 activations"):
        QwenImageModel.load(tiny_model("qwen_image"), device=torch.device("cuda"), dtype=torch.float32,
                            acceleration=DenoiserAcceleration(quantization=DiffusionQuantization("fp8"),
                                                              force_cutlass_fp8=True))
