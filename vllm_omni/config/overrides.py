"""The two highest-precedence layers: explicit CLI flags and `--stage-overrides`.

`--stage-overrides '{"0": {"gpu_memory_utilization": 0.8}, "2": {"enforce_eager": true}}'`
sets fields of single stages (flat deploy spellings, or nested `engine_args:` /
`runtime:` sections as in a legacy file). Explicit CLI flags such as
`--gpu-memory-utilization 0.5` apply to every stage, or only to `--stage-id N`
in the stage-based CLI where one process runs one stage.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.layers import Layer, read_stage_fields
from vllm_omni.config.schema import AR_FIELDS, DIFFUSION_FIELDS

STAGE_OVERRIDES = "--stage-overrides"
CLI_FLAGS = "CLI flags"

# Engine flags of `serve` that map onto stage fields. The tokenizer flag is not here: a
# stage that names its own tokenizer keeps it (spec 002 apply_cli_tokenizer).
STAGE_CLI_FIELDS = (
    "gpu_memory_utilization", "enforce_eager", "trust_remote_code", "enable_prefix_caching",
    "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype",
    "block_size", "tensor_parallel_size", "seed", "load_format", "max_tokens_limit",
    "num_replicas",  # --omni-dp-size-local (runtime.num_replicas)
    "enable_sleep_mode",
    *DIFFUSION_FIELDS,  # spec 001's diffusion flags, for the pipeline's diffusion stages
    *AR_FIELDS,  # and those of its AR stages
)


def parse_stage_overrides(overrides: str | Mapping[Any, Any] | None, *,
                          source: str = STAGE_OVERRIDES) -> Layer:
    """JSON text or an already-parsed mapping -> a validated Layer."""
    layer = Layer(source=source)
    if overrides is None or overrides == "":
        return layer
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON at character {exc.pos}: {exc.msg}", source=source) from None
    if not isinstance(overrides, Mapping):
        raise ConfigError("must be a JSON object keyed by stage id", source=source, value=overrides,
                          allowed='{"<stage_id>": {"<field>": <value>, ...}, ...}')
    for key, fields in overrides.items():
        try:
            stage_id = int(key)
        except (TypeError, ValueError):
            stage_id = -1
        if stage_id < 0 or isinstance(key, bool) or (isinstance(key, float) and not key.is_integer()):
            raise ConfigError(f"key {key!r} is not a stage id", source=source,
                              allowed='non-negative integers such as "0"')
        if not isinstance(fields, Mapping):
            raise ConfigError("must be an object of field -> value", source=source, stage_id=stage_id,
                              value=fields)
        if stage_id in layer.stages:
            raise ConfigError("stage given twice", source=source, stage_id=stage_id)
        layer.stages[stage_id] = read_stage_fields(dict(fields), source=source, stage_id=stage_id,
                                                   style="override")
    return layer


def cli_flags_layer(cli_args: Mapping[str, Any] | None, *, stage_id: int | None = None,
                    source: str = CLI_FLAGS) -> Layer:
    """Explicitly given flags only: a None value means "not on the command line" and is skipped."""
    layer = Layer(source=source)
    given = {k.replace("-", "_").lstrip("_"): v for k, v in (cli_args or {}).items() if v is not None}
    if unknown := sorted(k for k in given if k not in STAGE_CLI_FIELDS):
        raise ConfigError("cannot be applied to stages: " + ", ".join(f"--{k.replace('_', '-')}" for k in unknown),
                          source=source, allowed=", ".join(f"--{k.replace('_', '-')}" for k in STAGE_CLI_FIELDS))
    fields = read_stage_fields(given, source=source, stage_id=stage_id, style="override")
    if stage_id is None:
        layer.every_stage = fields
    else:
        layer.stages[stage_id] = fields
    return layer

