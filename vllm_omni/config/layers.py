"""Reading stage entries into validated layers.

A Layer is one source of settings (a YAML file, a platform delta, CLI flags,
the --stage-overrides JSON). Its values are already validated and flattened to
the canonical paths of schema.STAGE_FIELDS; build.py merges layers in
precedence order. Three spellings of a stage entry exist:

- legacy (spec 000): nested `runtime:` / `engine_args:` sections;
- deploy (spec 001): flat keys (`devices`, `gpu_memory_utilization`, ...) or upstream's nested
  `engine_args:` / `runtime:` / `engine_extras:`, no topology keys, since topology comes from
  the pipeline the file overlays;
- override (--stage-overrides, CLI): flat or nested, any field but stage_id.

Keys of upstream configs that the schema does not implement are decided by upstream_keys:
ignored (recorded as "ignored.<key>" for one warning), accepted as a no-op, or refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_omni.config import schema, upstream_keys, upstream_parallel
from vllm_omni.config.errors import BadValue, ConfigError, bad_value, unknown_keys
from vllm_omni.config.upstream_keys import IGNORED_PREFIX

Style = Literal["legacy", "deploy", "override"]


@dataclass
class Layer:
    source: str  # where the values came from, as shown in error messages
    stages: dict[int, dict[str, Any]] = field(default_factory=dict)  # stage id -> path -> value
    every_stage: dict[str, Any] = field(default_factory=dict)  # pipeline-wide stage settings
    top: dict[str, Any] = field(default_factory=dict)  # pipeline-level paths (runtime.*, ...)
    defines_topology: bool = False  # the layer that lists the pipeline's stages


_SECTIONS = ("runtime", "engine_args")
_CONNECTOR_KEY = {"input_connectors": re.compile(r"^from_stage_(\d+)$"),
                  "output_connectors": re.compile(r"^to_stage_(\d+)$")}
_FLAT = {**{k: f"runtime.{k}" for k in schema.RUNTIME_KEYS},
         **{k: f"engine_args.{k}" for k in schema.ENGINE_KEYS}}


def read_stage_list(entries: Any, *, source: str, section: str, style: Style) -> dict[int, dict[str, Any]]:
    """Read a YAML list of stage entries; duplicate stage ids are caught here. A legacy file
    defines the stages, so its list may not be empty; a deploy list of tweaks may."""
    if not isinstance(entries, list) or (style == "legacy" and not entries):
        raise ConfigError("must be a " + ("non-empty " if style == "legacy" else "") + "list of stage entries",
                          source=source, field=section, value=entries)
    stages: dict[int, dict[str, Any]] = {}
    first_index: dict[int, int] = {}
    for index, entry in enumerate(entries):
        where = f"{section}[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError("must be a mapping", source=source, field=where, value=entry)
        if "stage_id" not in entry:
            raise ConfigError("missing required key 'stage_id'", source=source, field=where)
        try:
            stage_id = schema.check_int(0)(entry["stage_id"])
        except BadValue as exc:
            raise bad_value(exc, source=source, stage_id=None, field=f"{where}.stage_id",
                            value=entry["stage_id"]) from None
        if stage_id in stages:
            raise ConfigError(f"duplicate stage_id {stage_id} ({section}[{first_index[stage_id]}] and {where})",
                              source=source, allowed="each stage_id once")
        first_index[stage_id] = index
        stages[stage_id] = read_stage_fields(entry, source=source, stage_id=stage_id, style=style)
    return stages


def read_stage_fields(entry: dict[str, Any], *, source: str, stage_id: int | None,
                      style: Style) -> dict[str, Any]:
    """Validate one stage entry and return {canonical path: value}; keys that are ignored here
    come back as {"ignored.<key>": reason} (build.py turns them into one warning)."""
    out: dict[str, Any] = {}
    allowed = _allowed_keys(style)
    # A topology key in a deploy stage gets its own message (_check_not_topology) below.
    unknown = [k for k in entry if k not in allowed and k != "stage_id" and not upstream_keys.is_policy_key(k)
               and not (style == "deploy" and _FLAT.get(k, k) in schema.TOPOLOGY_FIELDS)]
    if style == "legacy" and (misplaced := [k for k in unknown if k in _FLAT]):
        section = _FLAT[misplaced[0]].split(".")[0]
        raise ConfigError(f"belongs in the '{section}:' section of a legacy stage entry", source=source,
                          stage_id=stage_id, field=misplaced[0])
    if unknown:
        raise unknown_keys(unknown, allowed, source=source, stage_id=stage_id)
    chunk_processor = isinstance(entry.get("engine_args"), dict) and "chunk_processor" in entry["engine_args"]
    for key, value in entry.items():
        if key == "custom_process_input_func" and chunk_processor:
            # upstream's chunk processor feeds such a stage, never this function (its async-chunk
            # config even names one that does not exist): the family's bridges do both here
            out[f"{IGNORED_PREFIX}{key}"] = upstream_keys.PER_FAMILY_STREAMING
        elif key == "stage_id":
            if style == "override":
                raise ConfigError("stage_id cannot be overridden", source=source, stage_id=stage_id)
        elif key in _SECTIONS or key == "engine_extras":
            # upstream's deploy stages may nest `engine_args:` / `runtime:` and `engine_extras:` too
            section = "engine_args" if key == "engine_extras" else key
            _read_section(section, value, out, source=source, stage_id=stage_id, shown=key, style=style)
        elif key == "default_sampling_params":
            out.update(read_sampling(value, source=source, stage_id=stage_id))
        elif key == "subtalker_sampling_params":
            out.update(_read_subtalker(value, source=source, stage_id=stage_id))
        elif key == "tts_args":  # upstream's legacy TTS section
            out.update(_read_tts_args(value, source=source, stage_id=stage_id))
        elif key in _CONNECTOR_KEY:
            out.update(_read_connector_refs(key, value, source=source, stage_id=stage_id))
        elif key == "stage_type":  # upstream's: "llm" (ar / generation) or "diffusion"
            out["stage_type"] = check_field("stage_type", value, source=source, stage_id=stage_id, shown=key)
        elif key == "async_chunk":
            # per stage (upstream deploy): streaming is decided for the whole pipeline here
            check_bool_field("async_chunk", value, source=source, stage_id=stage_id)
            out[f"{IGNORED_PREFIX}async_chunk"] = upstream_keys.PER_STAGE_STREAMING
        elif key == upstream_parallel.KEY:  # upstream's diffusion stages (flat deploy key)
            out.update(upstream_parallel.read_parallel_config(value, source=source, stage_id=stage_id, shown=key))
        elif key in _FLAT or key in schema.TOP_STAGE_KEYS:
            path = _FLAT.get(key, key)
            _check_not_topology(path, key, style, source=source, stage_id=stage_id)
            out[path] = check_field(path, value, source=source, stage_id=stage_id, shown=key)
        else:
            _read_policy_key(key, value, out, source=source, stage_id=stage_id, shown=key)
    return out


def _allowed_keys(style: Style) -> set[str]:
    common = {"default_sampling_params", "stage_type", "max_tokens_limit", "subtalker_sampling_params",
              "tts_max_instructions_length", "tts_args", upstream_parallel.KEY, *_CONNECTOR_KEY}
    if style == "legacy":
        return common | set(schema.TOP_STAGE_KEYS) | set(_SECTIONS)
    deploy_flat = {k for k, p in _FLAT.items() if p not in schema.TOPOLOGY_FIELDS}
    if style == "deploy":
        return common | deploy_flat | set(_SECTIONS) | {"engine_extras", "async_chunk", "stage_type"}
    return common | set(_FLAT) | set(schema.TOP_STAGE_KEYS) | set(_SECTIONS)


def _check_not_topology(path: str, shown: str, style: Style, *, source: str, stage_id: int | None) -> None:
    if style == "deploy" and path in schema.TOPOLOGY_FIELDS:
        raise ConfigError(
            "is part of the pipeline topology and cannot be set in a deploy config "
            "(use a legacy stage_args YAML, or `pipeline:` naming one, to change topology)",
            source=source, stage_id=stage_id, field=shown)


def _read_policy_key(key: str, value: Any, out: dict[str, Any], *, source: str, stage_id: int | None,
                     shown: str) -> None:
    reason = upstream_keys.apply_policy(key, value, source=source, stage_id=stage_id, field=shown)
    if reason is not None:
        out[f"{IGNORED_PREFIX}{shown}"] = reason


def check_bool_field(shown: str, value: Any, *, source: str, stage_id: int | None) -> bool:
    try:
        return schema.check_bool(value)
    except BadValue as exc:
        raise bad_value(exc, source=source, stage_id=stage_id, field=shown, value=value) from None


def _read_section(section: str, value: Any, out: dict[str, Any], *, source: str, stage_id: int | None,
                  shown: str, style: Style) -> None:
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", source=source, stage_id=stage_id, field=shown, value=value)
    known = schema.RUNTIME_KEYS if section == "runtime" else schema.ENGINE_KEYS
    policy = section == "engine_args"
    unknown = [k for k in value if k not in known
               and not (policy and (upstream_keys.is_policy_key(k) or k in (*_STREAM_ARGS, upstream_parallel.KEY)))]
    if unknown:
        raise unknown_keys(unknown, known, source=source, stage_id=stage_id, section=shown)
    for key, v in value.items():
        where = f"{shown}.{key}"
        if section == "engine_args" and key in _STREAM_ARGS:
            out.update(_read_stream_arg(key, v, source=source, stage_id=stage_id, shown=where))
            continue
        if section == "engine_args" and key == upstream_parallel.KEY:
            out.update(upstream_parallel.read_parallel_config(v, source=source, stage_id=stage_id, shown=where))
            continue
        if key not in known:
            _read_policy_key(key, v, out, source=source, stage_id=stage_id, shown=where)
            continue
        path = f"{section}.{key}"
        _check_not_topology(path, where, style, source=source, stage_id=stage_id)
        out[path] = check_field(path, v, source=source, stage_id=stage_id, shown=where)


def check_field(path: str, value: Any, *, source: str, stage_id: int | None, shown: str) -> Any:
    try:
        return schema.STAGE_FIELDS[path].check(value)
    except BadValue as exc:
        raise bad_value(exc, source=source, stage_id=stage_id, field=shown, value=value) from None


def read_sampling(value: Any, *, source: str, stage_id: int | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", source=source, stage_id=stage_id,
                          field="default_sampling_params", value=value)
    unknown = [k for k in value if k not in schema.SAMPLING_KEYS]
    if unknown:
        raise unknown_keys(unknown, schema.SAMPLING_KEYS, source=source, stage_id=stage_id,
                           section="default_sampling_params")
    out = {}
    for key, v in value.items():
        try:
            out[f"default_sampling_params.{key}"] = schema.check_sampling_value(key, v)
        except BadValue as exc:
            raise bad_value(exc, source=source, stage_id=stage_id,
                            field=f"default_sampling_params.{key}", value=v) from None
    return out


def _read_connector_refs(key: str, value: Any, *, source: str, stage_id: int | None) -> dict[str, Any]:
    pattern = _CONNECTOR_KEY[key]
    example = pattern.pattern.strip("^$").replace(r"(\d+)", "<stage_id>")
    if value is None:  # upstream writes `output_connectors: null` for "none"
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"must be a mapping {{{example}: <connector name>}}", source=source,
                          stage_id=stage_id, field=key, value=value)
    out = {}
    for ref, name in value.items():
        match = pattern.match(str(ref))
        if not match:
            raise ConfigError("bad key", source=source, stage_id=stage_id, field=f"{key}.{ref}",
                              allowed=example)
        if not isinstance(name, str) or not name:
            raise ConfigError("bad connector name", source=source, stage_id=stage_id,
                              field=f"{key}.{ref}", value=name, allowed="a key of the top-level connectors:")
        out[f"{key}.{int(match.group(1))}"] = name
    return out


# Upstream v0.12's per-stage streaming engine args (its Qwen2.5-Omni async-chunk config).
_STREAM_ARGS = ("async_chunk_stream", "chunk_processor")
STAGE_STREAMS = "async_chunk_stream"  # a stage path build.py reads: the stage streams to the next
_UPSTREAM_CHUNK_PROCESSORS = "vllm_omni.model_executor.chunk_processors."


def _read_stream_arg(key: str, value: Any, *, source: str, stage_id: int | None, shown: str) -> dict[str, Any]:
    """`async_chunk_stream: true` on a stage is upstream's older spelling of `async_chunk: true`
    (build.py turns streaming on for the pipeline); `chunk_processor` names upstream's per-family
    chunk handlers, which this engine's family stream bridges replace."""
    if key == "async_chunk_stream":
        return {STAGE_STREAMS: check_bool_field(shown, value, source=source, stage_id=stage_id)}
    if value is None or (isinstance(value, str) and value.startswith(_UPSTREAM_CHUNK_PROCESSORS)):
        return {f"{IGNORED_PREFIX}{shown}": upstream_keys.PER_FAMILY_STREAMING}
    raise ConfigError("chunk_processor is not supported: streaming edges use the model family's stream bridges "
                      "(your own chunk processor cannot replace them)", source=source, stage_id=stage_id,
                      field=shown, value=value, allowed=f"one of upstream's {_UPSTREAM_CHUNK_PROCESSORS}* names, "
                                                         "or leave it out")


_SUBTALKER = "subtalker_sampling_params"


def _read_subtalker(value: Any, *, source: str, stage_id: int | None) -> dict[str, Any]:
    """Key by key (a base_config overlay changes one key and keeps the others, as upstream merges it);
    build.py checks the merged set."""
    from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", source=source, stage_id=stage_id, field=_SUBTALKER, value=value,
                          allowed="{do_sample, temperature, top_k, top_p}")
    try:
        PredictorSampling.parse(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc), source=source, stage_id=stage_id, field=_SUBTALKER, value=value,
                          allowed="{do_sample: bool, temperature: >= 0, top_k: -1 | 0 | k, top_p: (0, 1]}") from None
    return {f"{_SUBTALKER}.{k}": v for k, v in value.items()}


_TTS_ARGS = {"max_instructions_length": "tts_max_instructions_length"}


def _read_tts_args(value: Any, *, source: str, stage_id: int | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", source=source, stage_id=stage_id, field="tts_args", value=value)
    if unknown := [k for k in value if k not in _TTS_ARGS]:
        raise unknown_keys(unknown, tuple(_TTS_ARGS), source=source, stage_id=stage_id, section="tts_args")
    return {_TTS_ARGS[k]: check_field(_TTS_ARGS[k], v, source=source, stage_id=stage_id, shown=f"tts_args.{k}")
            for k, v in value.items()}


