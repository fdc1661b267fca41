"""Every stage field: its canonical path, validator and documented default.

A stage's settings are handled as a flat map from canonical dotted paths
("runtime.devices", "engine_args.gpu_memory_utilization",
"default_sampling_params.top_k") to values. Each input layer (legacy YAML,
deploy YAML, platform delta, CLI flags, --stage-overrides) is validated
against this table as it is read, so an error names the layer it came from;
layers are then merged path by path and built into the frozen dataclasses.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from vllm_omni.config import diffusion_accel
from vllm_omni.config.diffusion_accel import CACHE_DIT_KEYS, CACHE_DIT_REFUSED, TEA_CACHE_KEYS
from vllm_omni.config.errors import BadValue
from vllm_omni.config.own_names import foreign_name_problem
from vllm_omni.config.resolve import DOCUMENTED_SCHEDULERS
from vllm_omni.config.stage_config import EngineOutputType, FinalOutputType, WorkerType
from vllm_omni.model_executor.dtypes import DTYPE_SPELLINGS, canonical_dtype
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

Check = Callable[[Any], Any]


# --- validators: return the normalized value or raise BadValue(allowed) ------------------

def check_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise BadValue("true or false")


def check_int(lo: int | None = None, optional: bool = False, extra: tuple[int, ...] = ()) -> Check:
    allowed = "an integer" + (f" >= {lo}" if lo is not None else "")
    allowed += "".join(f" or {e}" for e in extra) + (" or null" if optional else "")

    def check(v: Any) -> int | None:
        if v is None and optional:
            return None
        # bool is an int in Python; `true` where a count is expected is a mistake.
        if isinstance(v, int) and not isinstance(v, bool) and (v in extra or lo is None or v >= lo):
            return v
        raise BadValue(allowed)
    return check


def check_fraction(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0:
        return float(v)
    raise BadValue("a number in (0, 1]")


def check_optional_fraction(v: Any) -> float | None:
    return None if v is None else check_fraction(v)


def check_positive_number(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    raise BadValue("a number > 0, or null")


def check_str(optional: bool = True) -> Check:
    def check(v: Any) -> str | None:
        if v is None and optional:
            return None
        if isinstance(v, str) and v.strip():
            return v
        raise BadValue("a non-empty string" + (" or null" if optional else ""))
    return check


def check_enum(enum_cls: type[Enum]) -> Check:
    allowed = " | ".join(repr(m.value) for m in enum_cls)

    def check(v: Any) -> Enum:
        try:
            return enum_cls(v)
        except ValueError:
            raise BadValue(allowed) from None
    return check


def check_choice(*choices: str) -> Check:
    def check(v: Any) -> str:
        if v in choices:
            return v
        raise BadValue(" | ".join(repr(c) for c in choices))
    return check


_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"^{_IDENT}(\.{_IDENT})+$")


def check_dotted(v: Any) -> str | None:
    """Syntax, and for names inside vllm_omni that they exist (own_names, read from our source
    files). A user's plugin is imported in resolve.validate_dotted_names, not at parse time."""
    if v is not None and not (isinstance(v, str) and _DOTTED.match(v)):
        raise BadValue("a dotted Python path 'package.module.Name' or null")
    problem = foreign_name_problem(v) if v is not None else None
    if problem is not None:
        raise BadValue("a name of this vllm-omni or a dotted path to your own code", problem)
    return v


def check_scheduler_cls(v: Any) -> str | None:
    """The scheduler is part of a stage's engine: the documented names select it, nothing else
    can replace it."""
    if v is None or v in DOCUMENTED_SCHEDULERS:
        return v
    if not (isinstance(v, str) and _DOTTED.match(v)):
        raise BadValue("a dotted Python path 'package.module.Name' or null")
    raise BadValue(" | ".join(DOCUMENTED_SCHEDULERS),
                   f"scheduler_cls {v!r} is not supported: the scheduler is part of the stage engine; "
                   "only the documented names select it")


def check_model_arch(v: Any) -> str | None:
    # A registered architecture name, or a user's dotted path to a model class (plugin).
    if v is None or (isinstance(v, str) and (re.fullmatch(_IDENT, v) or _DOTTED.match(v))):
        return v
    raise BadValue("an architecture name registered in model_executor/models/registry.py "
                   "or a dotted path to a model class")


_DEVICES = re.compile(r"^\d+(,\d+)*$")


def check_devices(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return str(v)  # `devices: 0` is unambiguous
    if isinstance(v, str) and _DEVICES.match(v.replace(" ", "")):
        ids = v.replace(" ", "").split(",")
        if len(set(ids)) == len(ids):
            return ",".join(ids)
    raise BadValue('a string of distinct device indices, e.g. "0" or "0,1"')


def check_stage_ids(v: Any) -> tuple[int, ...]:
    items = v if isinstance(v, list) else [v]
    if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        return tuple(items)
    raise BadValue("a stage id or a list of stage ids, e.g. [0]")


def check_env(v: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(v, dict) and all(isinstance(k, str) and k for k in v) \
            and all(isinstance(x, (str, int, float, bool)) for x in v.values()):
        return tuple((k, str(x)) for k, x in v.items())
    raise BadValue("a mapping of environment variable names to strings")


def check_json_object(v: Any) -> tuple[tuple[str, Any], ...]:
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return tuple(v.items())
    raise BadValue("a JSON object")


def check_cache_config(v: Any) -> tuple[tuple[str, Any], ...] | None:
    """TeaCache's settings (rel_l1_thresh > 0, 5 rescaling polynomial coefficients) or cache-dit's
    (config/diffusion_accel.py checks them against cache_backend once the stage is merged)."""
    if v is None:
        return None
    allowed = ("null, {\"rel_l1_thresh\": <number > 0>, \"coefficients\": [<5 numbers>]} (TeaCache) or cache-dit's "
               "keys (" + ", ".join(sorted(CACHE_DIT_KEYS)) + ")")
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise BadValue(allowed)
    if set(v) & set(TEA_CACHE_KEYS) and set(v) - set(TEA_CACHE_KEYS):
        raise BadValue(allowed + ": not both")
    if not set(v) <= set(TEA_CACHE_KEYS):
        if set(v) - set(CACHE_DIT_KEYS) - set(CACHE_DIT_REFUSED):
            raise BadValue(allowed)
        return tuple(v.items())
    thresh, coefficients = v.get("rel_l1_thresh", 0.2), v.get("coefficients", [0.0] * 5)
    number = (int, float)
    if isinstance(thresh, bool) or not isinstance(thresh, number) or thresh <= 0 \
            or not isinstance(coefficients, list) or len(coefficients) != 5 \
            or any(isinstance(c, bool) or not isinstance(c, number) for c in coefficients):
        raise BadValue(allowed)
    return tuple(v.items())


def check_cfg_parallel_size(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v in (1, 2):
        return v
    raise BadValue("1 or 2")


def check_attention_backend(v: Any) -> str | None:
    from vllm_omni.model_executor.models.diffusion_acceleration import attention_backend_problem

    if v is None:
        return None
    problem = attention_backend_problem(v) if isinstance(v, str) else "a backend name"
    if problem:
        raise BadValue(problem)
    return v.upper()


def check_dtype(v: Any) -> str:
    """Any spelling of model_executor.dtypes, stored canonical ("bf16" -> "bfloat16")."""
    try:
        return canonical_dtype(v)
    except ValueError:
        raise BadValue(" | ".join(repr(s) for s in DTYPE_SPELLINGS)) from None


@dataclass(frozen=True)
class FieldSpec:
    check: Check
    default: Any


# Engine args of diffusion stages (spec 001's diffusion flags; docs/diffusion.md).
DIFFUSION_FIELDS: dict[str, FieldSpec] = {
    "step_execution": FieldSpec(check_bool, False),  # our diffusion engine always steps
    "diffusion_load_format": FieldSpec(check_choice("default", "dummy", "diffusers"), "default"),
    "model_class_name": FieldSpec(check_str(), None),
    "diffusers_load_kwargs": FieldSpec(check_json_object, ()),
    "diffusers_call_kwargs": FieldSpec(check_json_object, ()),
    "cache_backend": FieldSpec(check_choice("none", "tea_cache", "cache_dit"), "none"),
    "cache_config": FieldSpec(check_cache_config, None),
    "enable_cache_dit_summary": FieldSpec(check_bool, False),
    "vae_use_slicing": FieldSpec(check_bool, False),
    "vae_use_tiling": FieldSpec(check_bool, False),
    "enable_cpu_offload": FieldSpec(check_bool, False),
    "cfg_parallel_size": FieldSpec(check_cfg_parallel_size, 1),
    # Sequence parallelism, HSDP, VAE patches and the world they make (config/diffusion_parallel.py).
    "ulysses_degree": FieldSpec(check_int(1), 1),
    "ulysses_mode": FieldSpec(check_choice("strict", "advanced_uaa"), "strict"),
    "ring_degree": FieldSpec(check_int(1), 1),
    "vae_patch_parallel_size": FieldSpec(check_int(1), 1),
    "use_hsdp": FieldSpec(check_bool, False),
    "hsdp_shard_size": FieldSpec(check_int(1, extra=(-1,)), -1),
    "hsdp_replicate_size": FieldSpec(check_int(1), 1),
    "num_gpus": FieldSpec(check_int(1, optional=True), None),
    "max_generated_image_size": FieldSpec(check_int(1, optional=True), None),
    # With enforce_eager false the transformer blocks are compiled (docs/diffusion.md).
    "diffusion_attention_backend": FieldSpec(check_attention_backend, None),
    "diffusion_compile_granularity": FieldSpec(check_choice("regional"), "regional"),
    "diffusion_compile_dynamic": FieldSpec(check_bool, True),
    # Video models (Wan2.2): the expert switch and the scheduler's shift; null: the checkpoint's.
    "boundary_ratio": FieldSpec(check_optional_fraction, None),
    "flow_shift": FieldSpec(check_positive_number, None),
    # Quantized weights, FP8 attention, attention roles (config/diffusion_accel.py; docs/diffusion.md).
    "diffusion_quantization_config": FieldSpec(diffusion_accel.check_quantization, None),
    "force_cutlass_fp8": FieldSpec(diffusion_accel.check_optional_flag, False),
    "diffusion_kv_cache_dtype": FieldSpec(diffusion_accel.check_kv_cache_dtype, None),
    "diffusion_kv_cache_skip_steps": FieldSpec(diffusion_accel.check_selector("diffusion_kv_cache_skip_steps"), ()),
    "diffusion_kv_cache_skip_layers": FieldSpec(diffusion_accel.check_selector("diffusion_kv_cache_skip_layers"), ()),
    "diffusion_attention_config": FieldSpec(diffusion_accel.check_attention_config, None),
    "auxiliary_text_encoder": FieldSpec(check_str(), None),
    # Each transformer block's weights wait on the CPU and are prefetched before it runs
    # (diffusion/layerwise_offload.py).
    "enable_layerwise_offload": FieldSpec(check_bool, False),
    # Per-request durations of prompt encoding, denoising and VAE decoding (stage_durations).
    "enable_diffusion_pipeline_profiler": FieldSpec(check_bool, False),
}

# Engine args that only AR stages use (spec 001's --enable-ar-profiler and the weight loader's
# threads; model_executor/model_loader.py).
AR_FIELDS: dict[str, FieldSpec] = {
    "enable_ar_profiler": FieldSpec(check_bool, False),
    "enable_multithread_weight_load": FieldSpec(check_bool, True),
    "num_weight_load_threads": FieldSpec(check_int(1), 4),
}

# Topology fields describe the model's stage graph; a deploy YAML may not set them
# (they come from the pipeline it overlays), every other layer may.
TOPOLOGY_FIELDS = frozenset({
    "engine_input_source", "custom_process_input_func", "is_comprehension", "final_output",
    "final_output_type", "requires_multimodal_data", "engine_args.model_stage",
    "engine_args.model_arch", "engine_args.worker_type", "engine_args.worker_cls",
    "engine_args.scheduler_cls", "engine_args.engine_output_type",
})

# Defaults are those documented in spec 000, with one derived default: spec 000 documents
# `final_output: true`, yet its own example leaves it unset on the talker, which only feeds
# code2wav ("the stage only works as an intermediate role"). An unset final_output is
# therefore true for a stage whose output no other stage consumes and false for one that
# feeds another stage (build.py); an explicit value always wins.
STAGE_FIELDS: dict[str, FieldSpec] = {
    "engine_input_source": FieldSpec(check_stage_ids, ()),
    "custom_process_input_func": FieldSpec(check_dotted, None),
    "is_comprehension": FieldSpec(check_bool, True),
    "final_output": FieldSpec(check_bool, None),  # derived, see above
    "final_output_type": FieldSpec(check_enum(FinalOutputType), FinalOutputType.TEXT),
    "requires_multimodal_data": FieldSpec(check_bool, False),
    # The most max_tokens a client may ask of this stage (None: no cap; the context bounds it). Not
    # in spec 000: a server limit, so any layer (YAML, --stage-overrides, --max-tokens-limit) sets it.
    "max_tokens_limit": FieldSpec(check_int(1, optional=True), None),
    # Upstream's TTS stage setting (deploy key, or `tts_args: {max_instructions_length}` in its
    # legacy files): the longest voice instructions a speech request may send; the server flag wins.
    "tts_max_instructions_length": FieldSpec(check_int(1, optional=True), None),
    "runtime.process": FieldSpec(check_bool, True),
    "runtime.devices": FieldSpec(check_devices, "0"),
    "runtime.max_batch_size": FieldSpec(check_int(1), 1),
    "runtime.num_replicas": FieldSpec(check_int(1), 1),
    "runtime.env": FieldSpec(check_env, ()),
    "engine_args.model_stage": FieldSpec(check_str(), None),
    "engine_args.model_arch": FieldSpec(check_model_arch, None),
    "engine_args.worker_type": FieldSpec(check_enum(WorkerType), None),  # derived, see build.py
    "engine_args.worker_cls": FieldSpec(check_dotted, None),
    "engine_args.scheduler_cls": FieldSpec(check_scheduler_cls, None),
    "engine_args.gpu_memory_utilization": FieldSpec(check_fraction, 0.8),
    "engine_args.enforce_eager": FieldSpec(check_bool, True),
    "engine_args.trust_remote_code": FieldSpec(check_bool, True),
    "engine_args.engine_output_type": FieldSpec(check_enum(EngineOutputType), EngineOutputType.LATENT),
    "engine_args.enable_prefix_caching": FieldSpec(check_bool, False),
    "engine_args.enable_chunked_prefill": FieldSpec(lambda v: None if v is None else check_bool(v), None),
    "engine_args.max_num_seqs": FieldSpec(check_int(1, optional=True), None),
    "engine_args.max_num_batched_tokens": FieldSpec(check_int(1, optional=True), None),
    "engine_args.max_model_len": FieldSpec(check_int(1, optional=True), None),
    "engine_args.dtype": FieldSpec(check_dtype, "auto"),
    "engine_args.block_size": FieldSpec(check_int(1, optional=True), None),
    "engine_args.tensor_parallel_size": FieldSpec(check_int(1), 1),
    "engine_args.model": FieldSpec(check_str(), None),
    "engine_args.tokenizer": FieldSpec(check_str(), None),
    "engine_args.seed": FieldSpec(check_int(0, optional=True), None),
    # "dummy": random weights of the real shapes, no checkpoint read (benchmarks, vLLM's flag).
    "engine_args.load_format": FieldSpec(check_choice("auto", "dummy"), "auto"),
    # vLLM's sleep mode: the stage frees its device memory on POST /sleep (worker/sleep_mode.py).
    "engine_args.enable_sleep_mode": FieldSpec(check_bool, False),
    # "llm" (AR or generation engines) or "diffusion" (upstream's spelling of worker_type: diffusion).
    "stage_type": FieldSpec(check_choice("llm", "diffusion"), None),
    **{f"engine_args.{name}": spec for name, spec in DIFFUSION_FIELDS.items()},
    **{f"engine_args.{name}": spec for name, spec in AR_FIELDS.items()},
}

RUNTIME_KEYS = tuple(p.split(".", 1)[1] for p in STAGE_FIELDS if p.startswith("runtime."))
ENGINE_KEYS = tuple(p.split(".", 1)[1] for p in STAGE_FIELDS if p.startswith("engine_args."))
TOP_STAGE_KEYS = tuple(p for p in STAGE_FIELDS if "." not in p)

# --- sampling parameters ----------------------------------------------------------------

SAMPLING_DEFAULTS: dict[str, Any] = {  # spec 000 `default_sampling_params` defaults
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048,
    "seed": 42, "detokenize": True, "repetition_penalty": 1.1,
}
TEXT_SAMPLING_KEYS = tuple(sorted(f.name for f in fields(SamplingParams) if not f.name.startswith("_")))
DIFFUSION_SAMPLING_KEYS = tuple(sorted(DiffusionSamplingParams.__struct_fields__))
# A layer does not know whether its stage is a diffusion stage; build.py checks the merged set.
SAMPLING_KEYS = tuple(sorted({*TEXT_SAMPLING_KEYS, *DIFFUSION_SAMPLING_KEYS}))
_SAMPLING_TYPES = {f.name: str(f.type) for f in fields(SamplingParams)}


def check_sampling_value(name: str, value: Any) -> Any:
    """Type check from the SamplingParams annotation, then its own range checks."""
    if name not in TEXT_SAMPLING_KEYS:
        try:
            DiffusionSamplingParams(**{name: value})
        except (TypeError, ValueError) as exc:
            raise BadValue(str(exc).split("must be ", 1)[-1]) from None
        return value
    kinds = [k.strip() for k in _SAMPLING_TYPES[name].split("|")]
    ok = any(_is_kind(value, k) for k in kinds)
    if not ok:
        raise BadValue(" or ".join(kinds).replace("None", "null"))
    try:
        # max_tokens=None switches off the cross-field check (min_tokens <= max_tokens): the
        # other value may come from another layer, so build.py checks the merged set.
        SamplingParams.from_dict({**SAMPLING_DEFAULTS, "max_tokens": None, name: value})
    except (TypeError, ValueError) as exc:
        raise BadValue(str(exc).split("must be ", 1)[-1]) from None
    return value


def _is_kind(v: Any, kind: str) -> bool:
    if kind == "None":
        return v is None
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind.startswith("list[") and isinstance(v, list):
        return all(_is_kind(x, kind[5:-1]) for x in v)
    return False


def stage_field_default(path: str) -> Any:
    if path.startswith("default_sampling_params."):
        return SAMPLING_DEFAULTS.get(path.split(".", 1)[1])
    return STAGE_FIELDS[path].default
