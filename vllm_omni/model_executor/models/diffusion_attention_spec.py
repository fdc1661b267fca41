"""What `--diffusion-attention-config` and `--diffusion-kv-cache-*` say, parsed and checked at the
config edge without torch (config/ reads it); diffusion_attention.py runs it (its docstring has the format)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
