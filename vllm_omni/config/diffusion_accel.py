"""Validators of the diffusion acceleration settings of spec 001 (quantization, FP8 attention,
attention roles, cache-dit, the auxiliary text encoder) and the checks between them, once a
stage's layers are merged. The typed values they produce live with the models that use them
(models/diffusion_quantization.py, models/diffusion_attention.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_omni.config.errors import BadValue
from vllm_omni.model_executor.models.diffusion_attention_spec import DiffusionAttentionConfig, parse_selector
from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization


def check_quantization(v: Any) -> DiffusionQuantization | None:
    try:
        return DiffusionQuantization.parse(v)
    except ValueError as e:
        raise BadValue(str(e)) from None


def check_attention_config(v: Any) -> DiffusionAttentionConfig | None:
    try:
        return DiffusionAttentionConfig.parse(v)
    except ValueError as e:
        raise BadValue(str(e)) from None


def check_kv_cache_dtype(v: Any) -> str | None:
    if v is None or v == "auto":  # vLLM's "auto": the model dtype, i.e. off
        return None
    if isinstance(v, str) and v.lower() == "fp8":
        return "fp8"
    raise BadValue("null or \"fp8\" (K and V of the diffusion attention through float8_e4m3fn)")


def check_selector(what: str) -> Callable[[Any], tuple[int, ...]]:
    def check(v: Any) -> tuple[int, ...]:
        try:
            return parse_selector(v, what)
        except ValueError as e:
            raise BadValue(str(e)) from None
    return check


def check_optional_flag(v: Any) -> bool:
    """A flag whose documented default is null (--force-cutlass-fp8): null is false."""
    if v is None or isinstance(v, bool):
        return bool(v)
    raise BadValue("true, false or null")


# --cache-config keys of cache_dit (cache-dit's names; db_cache.DBCacheConfig) and their checks.
def _int(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


CACHE_DIT_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "Fn_compute_blocks": (_int(1), "an integer >= 1"),
    "Bn_compute_blocks": (_int(0), "an integer >= 0"),
    "residual_diff_threshold": (_positive, "a number > 0"),
    "max_warmup_steps": (_int(0), "an integer >= 0"),
    "warmup_interval": (_int(1), "an integer >= 1"),
    "max_cached_steps": (_int(-1), "an integer >= -1 (-1: no limit)"),
    "max_continuous_cached_steps": (_int(-1), "an integer >= -1 (-1: no limit)"),
    "max_accumulated_residual_diff_threshold": (lambda v: v is None or _positive(v), "a number > 0 or null"),
    "steps_computation_mask": (lambda v: isinstance(v, list) and bool(v) and all(m in (0, 1) and not isinstance(m, bool)
                                                                                  for m in v),
                               "a non-empty list of 0 (reuse) and 1 (compute), one per step"),
    "steps_computation_policy": (lambda v: v in ("dynamic", "static"), "\"dynamic\" or \"static\""),
    "scm_steps_policy": (lambda v: v in ("dynamic", "static"), "\"dynamic\" or \"static\""),
    # Upstream's configs carry it next to enable_taylorseer: false (then it has nothing to order).
    "taylorseer_order": (_int(1), "an integer >= 1 (used by TaylorSeer, which is not implemented)"),
}
# Upstream vLLM-Omni's cache-dit keys that are not implemented, and why.
CACHE_DIT_REFUSED = {
    "enable_taylorseer": "TaylorSeer calibration is not implemented (the cached residual is reused as is)",
    "scm_steps_mask_policy": "cache-dit's predefined step masks are not implemented; give steps_computation_mask "
                             "(one 0/1 per step)",
}
TEA_CACHE_KEYS = ("rel_l1_thresh", "coefficients")


def cache_config_problem(backend: str, settings: dict[str, Any] | None) -> str | None:
    """Why --cache-config does not fit --cache-backend (None: it does)."""
    if not settings:
        return None
    if backend == "none":
        return "cache_config is set but cache_backend is none"
    if backend == "tea_cache":
        unknown = sorted(set(settings) - set(TEA_CACHE_KEYS))
        return f"unknown TeaCache key(s) {unknown}; allowed: {list(TEA_CACHE_KEYS)}" if unknown else None
    for key, value in settings.items():
        if key in CACHE_DIT_REFUSED and value not in (None, False):
            return f"{key} is not supported: {CACHE_DIT_REFUSED[key]}"
        if key in CACHE_DIT_REFUSED:
            continue
        if key not in CACHE_DIT_KEYS:
            return f"unknown cache_dit key {key!r}; allowed: {sorted(CACHE_DIT_KEYS)}"
        valid, allowed = CACHE_DIT_KEYS[key]
        if not valid(value):
            return f"cache_dit {key}={value!r}: expected {allowed}"
    return None


def combination_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, problem) for the diffusion settings of one stage that contradict each other."""
    problems = []
    backend, settings = values["cache_backend"], dict(values["cache_config"] or ())
    problem = cache_config_problem(backend, settings)
    if problem:
        problems.append(("cache_config", problem))
    if values["enable_cache_dit_summary"] and backend != "cache_dit":
        problems.append(("enable_cache_dit_summary", f"logs cache-dit's statistics; cache_backend is {backend}"))
    kv = values["diffusion_kv_cache_dtype"]
    for name in ("diffusion_kv_cache_skip_steps", "diffusion_kv_cache_skip_layers"):
        if values[name] and kv is None:
            problems.append((name, "selects what diffusion_kv_cache_dtype fp8 skips, and it is not set"))
    config = values["diffusion_attention_config"]
    if config is not None and values["diffusion_attention_backend"] is not None and config.default.backend:
        problems.append(("diffusion_attention_config", "default.backend and diffusion_attention_backend (its "
                                                       "shorthand) are both set; give one"))
    if config is not None and kv is not None:
        for role, spec in (("default", config.default), *config.per_role):
            if spec.quant is not None and spec.quant.method != kv:
                problems.append(("diffusion_attention_config", f"{role}.quant.method {spec.quant.method!r} contradicts "
                                                               f"diffusion_kv_cache_dtype {kv!r}"))
    quant = values["diffusion_quantization_config"]
    if values["enable_layerwise_offload"] and quant is not None and quant.method == "gguf":
        problems.append(("enable_layerwise_offload", "copies each block's plain tensors to the device; a GGUF "
                                                     "transformer's quantized parameters are not plain tensors: "
                                                     "choose one (FP8 weights do combine with it)"))
    problems += _parallel_problems(values)
    adapter_only = [n for n in ("diffusion_quantization_config", "diffusion_attention_config", "diffusion_kv_cache_dtype")
                    if values[n] is not None] + (["force_cutlass_fp8"] if values["force_cutlass_fp8"] else [])
    if values["diffusion_load_format"] == "diffusers":
        if backend == "cache_dit":
            adapter_only.append("cache_backend")
        problems += [(n, "is a setting of our diffusion engine; diffusion_load_format diffusers runs diffusers' "
                         "pipeline as it is") for n in adapter_only]
    return problems


def _parallel_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """Sequence parallelism and HSDP against the acceleration settings. FP8 K/V and a backend's
    kernel compose with Ulysses (its attention is local); ring attention merges key blocks by their
    log-sum-exp, which PyTorch's FlashAttention / memory-efficient kernels return and cuDNN's
    SDPA path does not; FSDP2 gathers float weights, not FP8 / GGUF layers' quantized tensors, and
    owns the blocks' weights that layerwise offload would keep in CPU memory."""
    problems = []
    config = values["diffusion_attention_config"]
    named = [values["diffusion_attention_backend"]]
    if config is not None:
        named += [config.default.backend, *(spec.backend for _, spec in config.per_role)]
    if values["ring_degree"] > 1 and any(b is not None and b.upper() == "CUDNN_ATTN" for b in named):
        problems.append(("ring_degree", "ring attention runs its key blocks on PyTorch's FlashAttention or "
                                        "memory-efficient kernel (they return the log-sum-exp its merge needs); "
                                        "the CUDNN_ATTN backend is set: use TORCH_SDPA or FLASH_ATTN, or "
                                        "ulysses_degree instead of ring_degree"))
    if values["use_hsdp"] and values["diffusion_quantization_config"] is not None:
        problems.append(("use_hsdp", "HSDP (FSDP2) shards float weights; diffusion_quantization_config's FP8 / GGUF "
                                     "layers hold quantized tensors and scales it does not gather: use one of them"))
    if values["use_hsdp"] and values["enable_layerwise_offload"]:
        problems.append(("enable_layerwise_offload", "keeps each transformer block's whole weights in CPU memory and "
                                                     "copies them into device buffers; use_hsdp shards those weights "
                                                     "over the ranks (FSDP2 gathers them itself): choose one "
                                                     "(sequence parallelism and cfg_parallel_size do combine with it)"))
    return problems
