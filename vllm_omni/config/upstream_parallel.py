"""Upstream's nested `parallel_config:` (its DiffusionParallelConfig) in a diffusion stage's entry.

    engine_args:
      parallel_config: {ulysses_degree: 2, ring_degree: 1, cfg_parallel_size: 1, use_hsdp: false}

Each key that this engine implements becomes the stage field of the same name (the flat spelling
`ulysses_degree: 2` and the flag `--usp 2` set the same field). Upstream's other keys follow the
tables of upstream_keys (accepted where their value says "off", refused otherwise, by name);
`tensor_parallel_size` here means tensor parallelism of the diffusion transformer.
"""
from __future__ import annotations

from typing import Any

from vllm_omni.config import schema, upstream_keys
from vllm_omni.config.errors import BadValue, ConfigError, bad_value, unknown_keys

KEY = "parallel_config"
# DiffusionParallelConfig fields that are our stage fields.
FIELDS = ("cfg_parallel_size", "ulysses_degree", "ulysses_mode", "ring_degree", "vae_patch_parallel_size",
          "use_hsdp", "hsdp_shard_size", "hsdp_replicate_size")
_DIT_TP = upstream_keys.Refusal("tensor parallelism of the diffusion transformer is not implemented (sequence "
                                "parallelism is: ulysses_degree, ring_degree)", (None, 1))


def read_parallel_config(value: Any, *, source: str, stage_id: int | None, shown: str) -> dict[str, Any]:
    """{canonical path: value} for the keys we implement (plus "ignored.<key>" reasons, as the
    other readers record them); ConfigError for a value this engine cannot honour."""
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping of DiffusionParallelConfig fields", source=source, stage_id=stage_id,
                          field=shown, value=value)
    if unknown := [k for k in value if k not in FIELDS and k != "tensor_parallel_size"
                   and not upstream_keys.is_policy_key(k)]:
        raise unknown_keys(unknown, (*FIELDS, "tensor_parallel_size"), source=source, stage_id=stage_id,
                           section=shown)
    out: dict[str, Any] = {}
    for key, v in value.items():
        where = f"{shown}.{key}"
        if key in FIELDS:
            path = f"engine_args.{key}"
            try:
                out[path] = schema.STAGE_FIELDS[path].check(v)
            except BadValue as exc:
                raise bad_value(exc, source=source, stage_id=stage_id, field=where, value=v) from None
        elif key == "tensor_parallel_size":
            if v not in _DIT_TP.neutral or isinstance(v, bool):
                raise ConfigError(f"{key} is not supported: {_DIT_TP.reason}", source=source, stage_id=stage_id,
                                  field=where, value=v, allowed="null or 1")
        elif (reason := upstream_keys.apply_policy(key, v, source=source, stage_id=stage_id, field=where)) is not None:
            out[f"{upstream_keys.IGNORED_PREFIX}{where}"] = reason
    return out
