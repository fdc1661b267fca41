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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.model_executor.layers.fp8_linear import FP8_DTYPE, FP8_MAX

BACKENDS = ("TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN")
REFUSED_BACKENDS = {
    "SAGE_ATTN": "SageAttention is not a dependency",
    "SAGE_ATTN_3": "SageAttention3 is not a dependency",
    "FLASHINFER_ATTN": "FlashInfer is not a dependency",
    "TRTLLM_ATTN": "FlashInfer's TRT-LLM kernels are not a dependency",
    "FLASH_ATTN_HUB": "Hugging Face `kernels` hub backends are not used",
    "FLASH_ATTN_3_HUB": "Hugging Face `kernels` hub backends are not used",
    "RAINFUSION_ATTN": "RainFusion is an Ascend NPU kernel",
    "SPARSE_BLOCK": "block-sparse attention is not implemented",
    "FASTVIDEO_VSA": "FastVideo's sparse attention is not a dependency",
    "ASCEND_ATTN": "an Ascend NPU kernel",
}
QUANT_METHODS = ("fp8", "float")
REFUSED_QUANT = {"mxfp8": "MXFP8 attention is an Ascend MindIE-SD kernel",
                 "mxfp4": "MXFP4 attention is an Ascend MindIE-SD kernel",
                 "int8": "INT8 (SageAttention) is not a dependency"}
# Backend-specific blocks of upstream's AttentionSpec, for backends that are not here.
REFUSED_SPEC_KEYS = {"skip_softmax": "TRTLLM_ATTN's", "block_sparse": "RAINFUSION_ATTN's",
                     "fastvideo_vsa_topk": "FASTVIDEO_VSA's"}
_QUANT_KEYS = ("method", "fallback", "skip_steps", "skip_layers", "rotation_seed")


def parse_selector(value: Any, what: str) -> tuple[int, ...]:
    """'0-9,20,25-30' (inclusive ranges) or a list of non-negative integers -> sorted indices."""
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(sorted(set(value)))
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what}: expected a selector such as '0-9,20,25-30' or a list of indices, got {value!r}")
    found: set[int] = set()
    for part in value.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{what}: {part.strip()!r} in {value!r} is not an index or an inclusive range "
                             "'a-b' of non-negative integers")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{what}: the range {part.strip()!r} in {value!r} runs backwards")
        found.update(range(first, last + 1))
    return tuple(sorted(found))


@dataclass(frozen=True)
class AttentionQuant:
    method: str = "float"  # "fp8": K and V through float8; "float": not quantized
    fallback: tuple[str, ...] = ()  # upstream's methods to try when the primary cannot run (ours always can)
    skip_steps: tuple[int, ...] = ()
    skip_layers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, value: Any, where: str) -> AttentionQuant:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object with 'method' ({' | '.join(QUANT_METHODS)})")
        unknown = sorted(set(value) - set(_QUANT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(_QUANT_KEYS)}")
        if "rotation_seed" in value:
            raise ValueError(f"{where}.rotation_seed: rotated (Hadamard) quantization is not implemented")
        method = _quant_method(value.get("method"), f"{where}.method")
        fallback = value.get("fallback", [])
        if not isinstance(fallback, list):
            raise ValueError(f"{where}.fallback: expected a list of methods")
        fallback = tuple(_quant_method(m, f"{where}.fallback") for m in fallback)
        if len(set(fallback)) != len(fallback) or method in fallback:
            raise ValueError(f"{where}.fallback: {list(fallback)} repeats a method")
        if "float" in fallback[:-1]:
            raise ValueError(f"{where}.fallback: 'float' may only be the last fallback")
        return cls(method, fallback, parse_selector(value.get("skip_steps"), f"{where}.skip_steps"),
                   parse_selector(value.get("skip_layers"), f"{where}.skip_layers"))


def _quant_method(value: Any, where: str) -> str:
    if isinstance(value, str) and value.lower() in QUANT_METHODS:
        return value.lower()
    if isinstance(value, str) and value.lower() in REFUSED_QUANT:
        raise ValueError(f"{where}: {value!r} is not supported ({REFUSED_QUANT[value.lower()]}); "
                         f"supported: {' | '.join(QUANT_METHODS)}")
    raise ValueError(f"{where}: {value!r} is not a quantization method; supported: {' | '.join(QUANT_METHODS)}")


def backend_problem(name: Any) -> str | None:
    """Why a backend name cannot be used here (None: it can)."""
    if isinstance(name, str) and name.upper() in BACKENDS:
        return None
    allowed = " | ".join(BACKENDS)
    if isinstance(name, str) and name.upper() in REFUSED_BACKENDS:
        return f"{name.upper()} is not available ({REFUSED_BACKENDS[name.upper()]}); one of {allowed}"
    return f"one of {allowed}"


@dataclass(frozen=True)
class AttentionSpec:
    backend: str | None = None
    quant: AttentionQuant | None = None

    @classmethod
    def parse(cls, value: Any, where: str) -> AttentionSpec:
        if isinstance(value, str):  # upstream's shorthand: {"default": "FLASH_ATTN"}
            value = {"backend": value}
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object such as {{\"backend\": \"TORCH_SDPA\"}}")
        for key in value:
            if key in REFUSED_SPEC_KEYS:
                raise ValueError(f"{where}.{key}: {REFUSED_SPEC_KEYS[key]} setting; that backend is not available")
            if key not in ("backend", "quant"):
                raise ValueError(f"{where}: unknown key {key!r}; allowed: backend, quant")
        backend = value.get("backend")
        if backend is not None and backend_problem(backend):
            raise ValueError(f"{where}.backend {backend!r}: expected {backend_problem(backend)}")
        quant = AttentionQuant.parse(value["quant"], f"{where}.quant") if value.get("quant") is not None else None
        return cls(backend.upper() if backend else None, quant)


@dataclass(frozen=True)
class DiffusionAttentionConfig:
    default: AttentionSpec = AttentionSpec()
    per_role: tuple[tuple[str, AttentionSpec], ...] = ()

    @classmethod
    def parse(cls, value: Any) -> DiffusionAttentionConfig | None:
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) - {"default", "per_role"}:
            raise ValueError('expected {"default": {...}, "per_role": {"<role>": {...}}}')
        default = AttentionSpec.parse(value.get("default") or {}, "default")
        roles = value.get("per_role") or {}
        if not isinstance(roles, dict):
            raise ValueError("per_role: expected an object of role -> spec")
        per_role = tuple(sorted((str(role), AttentionSpec.parse(spec, f"per_role.{role}"))
                                for role, spec in roles.items()))
        return cls(default, per_role)

    def spec_for(self, role: str, category: str) -> AttentionSpec:
        """per_role[role], else per_role[category], else default; a missing field comes from the next level."""
        roles = dict(self.per_role)
        chain = [roles.get(role), roles.get(category) if category != role else None, self.default]
        specs = [s for s in chain if s is not None]
        backend = next((s.backend for s in specs if s.backend is not None), None)
        quant = next((s.quant for s in specs if s.quant is not None), None)
        return AttentionSpec(backend, quant)


@dataclass(frozen=True)
class AttentionSettings:
    """Everything that decides how the stage's attention runs (validated config)."""

    config: DiffusionAttentionConfig | None = None
    kv_cache_dtype: str | None = None  # "fp8": every site's K/V quantized (unless a role says otherwise)
    kv_skip_steps: tuple[int, ...] = ()
    kv_skip_layers: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        """Whether any site needs per-site control (then the model runs its own blocks)."""
        return self.config is not None or self.kv_cache_dtype is not None

    def check_roles(self, roles: Mapping[str, str], model: str) -> None:
        """A per_role key that is neither a role nor a category of the model's sites is an error."""
        known = set(roles) | set(roles.values())
        for role, _ in (self.config.per_role if self.config else ()):
            if role not in known:
                raise ValueError(f"diffusion_attention_config.per_role.{role}: {model} has no such attention; its roles: "
                                 + ", ".join(f"{r} (category {c})" for r, c in roles.items()))


# --- running one attention ---------------------------------------------------------------------

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

    def kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [rows, heads, tokens, dim] as the kernel sees them: FP8 for the rows whose
        step is not skipped."""
        if not self.quantize:
            return k, v
        steps = _ROW_STEPS.get()
        rows = [s not in self.skip_steps for s in steps] if steps is not None else [True] * k.shape[0]
        if len(rows) != k.shape[0]:
            raise RuntimeError(f"{len(rows)} row steps for a batch of {k.shape[0]} rows")
        if not any(rows):
            return k, v
        self.stats[(self.role, self.layer)] += sum(rows)
        kq, vq = fp8_per_head(k), fp8_per_head(v)
        if all(rows):
            return kq, vq
        mask = torch.tensor(rows, device=k.device).view(-1, 1, 1, 1)
        return torch.where(mask, kq, k), torch.where(mask, vq, v)

    @contextlib.contextmanager
    def kernel(self, device: torch.device) -> Iterator[None]:
        with sdpa_backend(self.backend, device):
            yield


def fp8_per_head(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, tokens, dim] quantized to float8_e4m3fn with one absmax scale per (row,
    head) and multiplied back, in x's dtype."""
    scale = (x.abs().amax(dim=(-2, -1), keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
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
