"""How a diffusion stage's transformer runs on its device: attention kernels, torch.compile, FP8.

- `diffusion_attention_backend` (spec 001; upstream's names): TORCH_SDPA lets PyTorch's
  scaled_dot_product_attention choose its kernel; CUDNN_ATTN puts cuDNN's fused attention first
  and keeps the others behind it (a shape cuDNN cannot run still runs); FLASH_ATTN is PyTorch's
  FlashAttention-2 kernel alone. Default: CUDNN_ATTN on CUDA (what recent PyTorch picks on Hopper
  anyway), TORCH_SDPA elsewhere. It is the shorthand of `diffusion_attention_config`'s default;
  per-role settings and FP8 K/V are models/diffusion_attention.py. diffusers' blocks mask padded
  prompts; FLASH_ATTN's kernel takes no mask, so with it (and with per-role settings) the model
  runs its own blocks, which attend per prompt length instead.
- Quantized weights (`diffusion_quantization_config`, `force_cutlass_fp8`):
  models/diffusion_quantization.py.
- Regional compilation (upstream's default without `enforce_eager`): the model compiles its
  repeated transformer block once with torch.compile and every block runs the compiled code;
  the parts around the blocks stay eager (TeaCache splits the forward there). On CUDA only: on
  the CPU compilation costs more than it saves at our sizes, and the CPU path stays the
  reference math (diffusers' own modules).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings, backend_problem
from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
from vllm_omni.model_executor.models.diffusion_attention import AttentionSite, build_sites, sdpa_backend
from vllm_omni.model_executor.models.diffusion_quantization import check_force_cutlass
from vllm_omni.model_executor.models.diffusion_quantization import describe as describe_quantization
from vllm_omni.model_executor.models.diffusion_quantization import quantize_blocks, use_scaled_mm



def attention_backend_problem(name: str) -> str | None:
    """Why this engine cannot honour a diffusion_attention_backend name (None: it can)."""
    return backend_problem(name)


@dataclass(frozen=True)
class DenoiserAcceleration:
    attention_backend: str | None = None  # None: CUDNN_ATTN on CUDA, TORCH_SDPA elsewhere
    compile: bool = False  # regional torch.compile of the repeated blocks (CUDA only)
    compile_dynamic: bool = True  # shapes that change are compiled symbolic (else: one compilation per shape)
    attention: AttentionSettings = AttentionSettings()  # per-role backends, FP8 K/V (models/diffusion_attention.py)
    quantization: DiffusionQuantization | None = None  # online FP8 / GGUF (models/diffusion_quantization.py)
    force_cutlass_fp8: bool = False  # FP8 layers must run on torch._scaled_mm

    def __post_init__(self) -> None:
        if self.attention_backend is not None and attention_backend_problem(self.attention_backend):
            raise ValueError(f"diffusion_attention_backend {self.attention_backend!r}: expected "
                             f"{attention_backend_problem(self.attention_backend)}")
        config = self.attention.config
        if self.attention_backend is not None and config is not None and config.default.backend is not None:
            raise ValueError("--diffusion-attention-backend is the shorthand of diffusion_attention_config.default."
                             "backend: give one of them")

    def backend_for(self, device: torch.device) -> str:
        """The stage's default attention backend (a role's own one comes from the attention config)."""
        config = self.attention.config
        if config is not None and config.default.backend is not None:
            return config.default.backend
        if self.attention_backend is not None:
            return self.attention_backend.upper()
        return "CUDNN_ATTN" if device.type == "cuda" else "TORCH_SDPA"

    def own_blocks(self, device: torch.device) -> bool:
        """Whether the model runs its own block implementations (compiled on CUDA, or eager where
        attention needs per-site control: roles, FP8 K/V, FLASH_ATTN's unmasked kernel) instead of
        diffusers' blocks (the reference math)."""
        return self.compiles(device) or self.attention.active or self.backend_for(device) == "FLASH_ATTN"

    @contextlib.contextmanager
    def attention_context(self, device: torch.device) -> Iterator[None]:
        """The context diffusers' own blocks run in: the SDPA kernels in the default backend's order
        (our blocks choose per attention site)."""
        with sdpa_backend(self.backend_for(device), device):
            yield

    def attention_sites(self, roles: dict[str, str], layers: int, device: torch.device, dtype: torch.dtype,
                        model: str) -> dict[str, list[AttentionSite]]:
        self.attention.check_roles(roles, model)
        return build_sites(self.attention, roles, layers, self.backend_for(device), device, dtype)

    def prepare_transformers(self, block_lists: list[Any], device: torch.device, dtype: torch.dtype) -> None:
        """Online FP8 of the blocks (when asked) and the --force-cutlass-fp8 checks."""
        if self.quantization is not None and self.quantization.method == "fp8":
            for blocks in block_lists:
                quantize_blocks(blocks, self.quantization, device=device, dtype=dtype,
                                force_cutlass=self.force_cutlass_fp8)
        elif self.force_cutlass_fp8:
            use_scaled_mm(device, dtype, force_cutlass=True)  # an FP8 checkpoint loaded: the GEMM must run
        check_force_cutlass(block_lists, self.force_cutlass_fp8)

    def compiles(self, device: torch.device) -> bool:
        return self.compile and device.type == "cuda"

    def compile_fn(self, fn: Any) -> Any:
        # dynamic: torch's automatic mode (static kernels for the first shape; a dimension that
        # changes later is recompiled once as symbolic), so a fixed-shape workload keeps the
        # faster static kernels (~4% per step at 1024^2) and mixed sizes do not recompile each time.
        return torch.compile(fn, dynamic=None if self.compile_dynamic else False)

    def describe(self, device: torch.device, block_lists: list[Any] = ()) -> dict[str, Any]:
        compiled = ("dynamic" if self.compile_dynamic else "static") if self.compiles(device) else "off"
        extra = {"kv_cache_dtype": self.attention.kv_cache_dtype} if self.attention.kv_cache_dtype else {}
        return {"attention_backend": self.backend_for(device), "compile": compiled, **extra,
                **describe_quantization(list(block_lists))}


def fused_gelu_mlp(ff: Any, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward (Linear + tanh GELU, then Linear) with the GELU in the first GEMM's
    epilogue (cuBLASLt): the [tokens, 4 * dim] activation is written once instead of three times.
    A quantized first layer (FP8, GGUF) runs as diffusers' module does."""
    proj, out = ff.net[0].proj, ff.net[2]
    if type(proj) is not nn.Linear:
        return out(ff.net[0](x))
    hidden = torch._addmm_activation(proj.bias, x.flatten(0, -2), proj.weight.t(), use_gelu=True)
    return out(hidden.unflatten(0, x.shape[:-1]))
