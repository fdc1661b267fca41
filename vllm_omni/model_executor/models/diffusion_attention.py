"""Per-role attention of the diffusion transformers: `--diffusion-attention-config` (upstream's
shape) and `--diffusion-kv-cache-dtype fp8` with its skip selectors.

    {"default": {"backend": "CUDNN_ATTN"},
     "per_role": {"self": {"backend": "FLASH_ATTN", "quant": {"method": "fp8", "skip_steps": "0,1"}},
                  "cross": {"backend": "TORCH_SDPA", "quant": {"method": "float"}}}}

Each attention call site of a model has a role and a layer index (its block's, counted per
transformer): Qwen-Image has one "joint" attention per block (category "self": text and image
attend together), Wan2.2 a "self" and a "cross" attention per block. A site's spec is
per_role[role], else per_role[category], else default, else the stage default
(`--diffusion-attention-backend`, itself CUDNN_ATTN on CUDA and TORCH_SDPA elsewhere).

Backends are PyTorch's fused attention kernels: TORCH_SDPA (PyTorch picks), CUDNN_ATTN (cuDNN
first, the others behind it) and FLASH_ATTN (PyTorch's built-in FlashAttention-2 kernel only;
half precision on CUDA). Others (SAGE_ATTN, FLASHINFER_ATTN, ...) are refused by name.

Quantized attention ("fp8", or `diffusion_kv_cache_dtype: fp8` for every site): a site's K and
V pass through float8_e4m3fn with one scale per (row, head) before the attention kernel, except
in the skipped steps (each request's own denoising step, counted over the whole request: Wan2.2's
expert switch does not restart it) and the skipped layers. PyTorch has no FP8 attention kernel,
so the quantized K and V are multiplied back by their scales for the kernel: this models the
precision an FP8 KV path has (its effect on the image), not its speed. Upstream's "mxfp8" and
"mxfp4" (Ascend MindIE-SD kernels) and Hadamard rotations (`rotation_seed`) are refused by name.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionQuant, AttentionSettings, DiffusionAttentionConfig
from vllm_omni.model_executor.layers.fp8_linear import FP8_DTYPE, FP8_MAX

# --- running one attention ---------------------------------------------------------------------

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]  # a per-(row, head) absmax -> its maximum over ranks
_ROW_STEPS: contextvars.ContextVar[Sequence[int] | None] = contextvars.ContextVar("diffusion_row_steps", default=None)


@contextlib.contextmanager
def row_steps(steps: Sequence[int] | None) -> Iterator[None]:
    """The denoising step of each row of the batch the blocks run on (quantization skip steps)."""
    token = _ROW_STEPS.set(steps)
    try:
        yield
    finally:
        _ROW_STEPS.reset(token)


def rows_steps(steps: Sequence[int], rows: torch.Tensor | None) -> Sequence[int] | None:
    """The steps of a batch's `rows` (None: all). Reading an index tensor waits for the device:
    models ask only when a site quantizes by step."""
    if not steps:
        return None
    return steps if rows is None else tuple(steps[i] for i in rows.tolist())


@dataclass
class AttentionSite:
    """One attention call site (a role in one block) with its resolved backend and quantization."""

    role: str
    layer: int
    backend: str
    quantize: bool  # K/V through FP8 at this layer (in steps that are not skipped)
    skip_steps: frozenset[int] = frozenset()
    stats: Counter = field(default_factory=Counter)  # rows whose K/V were quantized, per (role, layer)

    def kv(self, k: torch.Tensor, v: torch.Tensor,
           reduce_amax: AmaxReduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [rows, heads, tokens, dim] as the kernel sees them: FP8 for the rows whose
        step is not skipped. `reduce_amax`: the scales' absmax over every rank's tokens when the
        tokens are split across ranks (sequence parallelism), so each rank quantizes its tokens
        exactly as one process quantizes all of them."""
        if not self.quantize:
            return k, v
        steps = _ROW_STEPS.get()
        rows = [s not in self.skip_steps for s in steps] if steps is not None else [True] * k.shape[0]
        if len(rows) != k.shape[0]:
            raise RuntimeError(f"{len(rows)} row steps for a batch of {k.shape[0]} rows")
        if not any(rows):
            return k, v
        self.stats[(self.role, self.layer)] += sum(rows)
        kq, vq = fp8_per_head(k, reduce_amax), fp8_per_head(v, reduce_amax)
        if all(rows):
            return kq, vq
        mask = torch.tensor(rows, device=k.device).view(-1, 1, 1, 1)
        return torch.where(mask, kq, k), torch.where(mask, vq, v)

    @contextlib.contextmanager
    def kernel(self, device: torch.device) -> Iterator[None]:
        with sdpa_backend(self.backend, device):
            yield


def fp8_per_head(x: torch.Tensor, reduce_amax: AmaxReduce | None = None) -> torch.Tensor:
    """x [rows, heads, tokens, dim] quantized to float8_e4m3fn with one absmax scale per (row,
    head) and multiplied back, in x's dtype."""
    amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


@contextlib.contextmanager
def sdpa_backend(backend: str, device: torch.device) -> Iterator[None]:
    """scaled_dot_product_attention's kernel choice for a backend name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "FLASH_ATTN":
        order = [SDPBackend.FLASH_ATTENTION]
    elif backend == "CUDNN_ATTN" and device.type == "cuda":
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
    else:  # TORCH_SDPA, or cuDNN off CUDA: PyTorch's own choice
        yield
        return
    with sdpa_kernel(order, set_priority=backend != "FLASH_ATTN"):
        yield


def build_sites(settings: AttentionSettings, roles: Mapping[str, str], layers: int, default_backend: str,
                device: torch.device, dtype: torch.dtype) -> dict[str, list[AttentionSite]]:
    """Per role, one resolved site per layer (block) of a transformer."""
    config = settings.config or DiffusionAttentionConfig()
    stats: Counter = Counter()
    sites: dict[str, list[AttentionSite]] = {}
    for role, category in roles.items():
        spec = config.spec_for(role, category)
        backend = spec.backend or default_backend
        if backend == "FLASH_ATTN" and device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention role {role!r}: FLASH_ATTN runs float16 / bfloat16 on CUDA; this stage's dtype "
                             f"is {str(dtype).removeprefix('torch.')} (use TORCH_SDPA or CUDNN_ATTN)")
        quant = spec.quant or AttentionQuant("fp8" if settings.kv_cache_dtype == "fp8" else "float")
        skip_layers = set(quant.skip_layers) | set(settings.kv_skip_layers)
        skip_steps = frozenset(set(quant.skip_steps) | set(settings.kv_skip_steps))
        sites[role] = [AttentionSite(role, layer, backend, quant.method == "fp8" and layer not in skip_layers,
                                     skip_steps, stats) for layer in range(layers)]
    return sites
