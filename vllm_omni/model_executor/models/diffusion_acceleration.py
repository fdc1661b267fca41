"""How a diffusion stage's transformer runs on its device: the attention kernel and torch.compile.

- `diffusion_attention_backend` (spec 001; upstream's names): TORCH_SDPA lets PyTorch's
  scaled_dot_product_attention choose its kernel; CUDNN_ATTN puts cuDNN's fused attention first
  and keeps the others behind it (a shape cuDNN cannot run still runs). Default: CUDNN_ATTN on
  CUDA (what recent PyTorch picks on Hopper anyway), TORCH_SDPA elsewhere. Backends whose
  kernels take no attention mask (FLASH_ATTN, SAGE_ATTN, ...) are refused: the eager path pads
  batches of prompts of different lengths and masks the padding.
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

# Upstream's backend names (vllm-omni's diffusion attention selector) whose kernels take a mask.
ATTENTION_BACKENDS = ("TORCH_SDPA", "CUDNN_ATTN")
_UNMASKED_ONLY = {"FLASH_ATTN", "FLASHINFER_ATTN", "SAGE_ATTN", "SPARSE_BLOCK"}


def attention_backend_problem(name: str) -> str | None:
    """Why this engine cannot honour a diffusion_attention_backend name (None: it can)."""
    if name.upper() in ATTENTION_BACKENDS:
        return None
    if name.upper() in _UNMASKED_ONLY:
        return (f"one of {' | '.join(ATTENTION_BACKENDS)} ({name.upper()}'s kernel takes no attention mask, which "
                "the eager path needs for batches of prompts of different lengths)")
    return f"one of {' | '.join(ATTENTION_BACKENDS)}"


@dataclass(frozen=True)
class DenoiserAcceleration:
    attention_backend: str | None = None  # None: CUDNN_ATTN on CUDA, TORCH_SDPA elsewhere
    compile: bool = False  # regional torch.compile of the repeated blocks (CUDA only)
    compile_dynamic: bool = True  # shapes that change are compiled symbolic (else: one compilation per shape)

    def __post_init__(self) -> None:
        if self.attention_backend is not None and attention_backend_problem(self.attention_backend):
            raise ValueError(f"diffusion_attention_backend {self.attention_backend!r}: expected "
                             f"{attention_backend_problem(self.attention_backend)}")

    def backend_for(self, device: torch.device) -> str:
        if self.attention_backend is not None:
            return self.attention_backend.upper()
        return "CUDNN_ATTN" if device.type == "cuda" else "TORCH_SDPA"

    @contextlib.contextmanager
    def attention(self, device: torch.device) -> Iterator[None]:
        """The context a forward runs in: the SDPA kernels in the chosen order."""
        if self.backend_for(device) != "CUDNN_ATTN" or device.type != "cuda":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            yield

    def compiles(self, device: torch.device) -> bool:
        return self.compile and device.type == "cuda"

    def compile_fn(self, fn: Any) -> Any:
        # dynamic: torch's automatic mode (static kernels for the first shape; a dimension that
        # changes later is recompiled once as symbolic), so a fixed-shape workload keeps the
        # faster static kernels (~4% per step at 1024^2) and mixed sizes do not recompile each time.
        return torch.compile(fn, dynamic=None if self.compile_dynamic else False)

    def describe(self, device: torch.device) -> dict[str, Any]:
        compiled = ("dynamic" if self.compile_dynamic else "static") if self.compiles(device) else "off"
        return {"attention_backend": self.backend_for(device), "compile": compiled}


def fused_gelu_mlp(ff: Any, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward (Linear + tanh GELU, then Linear) with the GELU in the first GEMM's
    epilogue (cuBLASLt): the [tokens, 4 * dim] activation is written once instead of three times."""
    proj, out = ff.net[0].proj, ff.net[2]
    hidden = torch._addmm_activation(proj.bias, x.flatten(0, -2), proj.weight.t(), use_gelu=True)
    return out(hidden.unflatten(0, x.shape[:-1]))
