"""`--diffusion-quantization-config` and `--force-cutlass-fp8`: the diffusion transformer's weights.

Two methods (spec 001's JSON; anything else is refused by name):

- `{"method": "fp8"}`: online FP8. After loading, every linear layer of the transformer blocks
  (attention projections, MLPs, modulations) is quantized to float8_e4m3fn with one scale per
  output channel; activations are quantized per token at run time (layers/fp8_linear.py).
  The embedders and the output head stay in the model dtype. `"ignored_layers": [...]` keeps
  the block layers whose dotted name (e.g. "transformer_blocks.0.img_mod.1") contains one of
  the strings in the model dtype; `"activation_scheme"` may only be "dynamic" (static
  activation scales need a calibration run, which online quantization does not have).
- `{"method": "gguf", "gguf_model": "/path/to/transformer.gguf"}`: the transformer's weights
  come from a GGUF file (models/quantized_checkpoints.py).

A diffusers folder whose transformer is a ModelOpt FP8 checkpoint (`quantization_config` in its
config.json) loads as FP8 too, without this flag (models/quantized_checkpoints.py).

The FP8 GEMM is `torch._scaled_mm` (cuBLASLt; upstream's "CUTLASS FP8" path) wherever it can
run: a CUDA GPU of compute capability 8.9+ and a bfloat16 stage. Elsewhere the layers compute
the same quantized product dequantized (slower than bf16 on a GPU; the CPU reference).
`--force-cutlass-fp8` makes that fallback an error: the stage refuses to start unless its FP8
layers run on `_scaled_mm`, and it refuses a stage without FP8 weights.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
from vllm_omni.model_executor.layers.fp8_linear import Fp8Linear, fp8_gemm_problem, quantize_linears

logger = logging.getLogger(__name__)


def use_scaled_mm(device: torch.device, dtype: torch.dtype, force_cutlass: bool) -> bool:
    """Whether FP8 layers run on torch._scaled_mm. With force_cutlass, a reason it cannot is an error."""
    problem = fp8_gemm_problem(device)
    if problem is None and dtype != torch.bfloat16:
        problem = f"the FP8 GEMM takes bfloat16 activations; this stage's dtype is {str(dtype).removeprefix('torch.')}"
    if problem is None:
        return True
    if force_cutlass:
        raise ValueError(f"--force-cutlass-fp8: {problem}")
    if device.type == "cuda":
        logger.warning("FP8 weights run dequantized (slower than bf16): %s", problem)
    return False


def quantize_blocks(blocks: nn.Module, quantization: DiffusionQuantization, *, device: torch.device,
                    dtype: torch.dtype, force_cutlass: bool) -> int:
    """Online FP8 of the transformer blocks' linear layers; the number quantized."""
    scaled = use_scaled_mm(device, dtype, force_cutlass)
    count = quantize_linears(blocks, use_scaled_mm=scaled,
                             skip=lambda name: any(s in name for s in quantization.ignored_layers))
    logger.info("online FP8: %d linear layers quantized (kernel: %s)", count, "scaled_mm" if scaled else "dequantized")
    return count


def fp8_layers(module: nn.Module) -> int:
    return sum(isinstance(m, Fp8Linear) for m in module.modules())


def check_force_cutlass(transformers: list[nn.Module], force_cutlass: bool) -> None:
    """--force-cutlass-fp8 on a stage whose transformers have no FP8 layer is an error (it would do nothing)."""
    if force_cutlass and not any(fp8_layers(t) for t in transformers):
        raise ValueError("--force-cutlass-fp8 applies to FP8 weights and this stage's transformer has none "
                         "(use --diffusion-quantization-config '{\"method\": \"fp8\"}' or an FP8 checkpoint)")


def describe(transformers: list[nn.Module]) -> dict[str, Any]:
    """What a stage reports about its FP8 layers (nothing without any)."""
    layers = [m for t in transformers for m in t.modules() if isinstance(m, Fp8Linear)]
    if not layers:
        return {}
    scaled = sum(m.use_scaled_mm for m in layers)
    return {"quantization": "fp8", "fp8_layers": len(layers), "fp8_scaled_mm_layers": scaled}
