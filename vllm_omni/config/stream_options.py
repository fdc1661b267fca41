"""A connector's chunk options reach the decoder stage behind it (docs/streaming.md).

A connector's `extra` holds transport options (TRANSPORT_OPTIONS below) and chunk options
(upstream's `codec_chunk_frames`, ...): the latter configure how the generation stage whose
input edge uses the connector cuts its input into chunks (`StageConfig.stream_options`).

- Parse time (`attach_stream_options`, no imports): each generation stage gets the chunk
  options of the connectors on its input edges; a connector with chunk options whose edges
  lead to no generation stage, or two connectors that disagree on a stage's option, is a
  ConfigError.
- Startup (`check_stream_options`, imports the model classes; `validate_dotted_names` runs
  it): the stage's model must declare the options it takes and accept every key and value,
  else a ConfigError naming the stage and the key.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import ConnectorConfig, EdgeConfig, PipelineConfig, StageConfig, WorkerType

# Options of the transport itself, ignored with the reason (toplevel.read_connectors); every
# other option of a connector's `extra` is a chunk option.
TRANSPORT_OPTIONS = {
    "shm_threshold_bytes": "the shared-memory threshold is --shm-threshold-bytes, for every edge",
}


def _options_of(connector: ConnectorConfig) -> dict[str, Any]:
    return {key: value for key, value in connector.extra if key not in TRANSPORT_OPTIONS}


def attach_stream_options(stages: Sequence[StageConfig], edges: Sequence[EdgeConfig],
                          connectors: Sequence[ConnectorConfig], *, source: str) -> tuple[StageConfig, ...]:
    """The stages, each generation stage with the chunk options of its input connectors."""
    by_key = {c.key: c for c in connectors}
    decoders = {s.stage_id for s in stages if s.worker_type == WorkerType.GENERATION}
    for key, connector in by_key.items():
        options = _options_of(connector)
        fed = sorted({e.to_stage for e in edges if e.connector == key})
        if options and fed and not decoders.intersection(fed):  # (a connector on no edge changes nothing)
            option = next(iter(options))
            raise ConfigError(f"is a chunk option of a decoder (generation) stage, and connector {key!r} feeds "
                              f"none: it is on the input edges of stages {', '.join(map(str, fed))}", source=source,
                              field=f"connectors.{key}.extra.{option}", value=options[option],
                              allowed="chunk options on a connector of a code2wav stage's input edge")
    out = []
    for stage in stages:
        options: dict[str, Any] = {}
        for edge in edges:
            if edge.to_stage != stage.stage_id or edge.connector is None or stage.stage_id not in decoders:
                continue
            for option, value in _options_of(by_key[edge.connector]).items():
                if options.get(option, value) != value:
                    raise ConfigError(f"the connectors on stage {stage.stage_id}'s input edges disagree on it "
                                      f"({options[option]!r} and {value!r})", source=source,
                                      stage_id=stage.stage_id, field=f"connectors.{edge.connector}.extra.{option}",
                                      value=value)
                options[option] = value
        out.append(replace(stage, stream_options=tuple(options.items())) if options else stage)
    return tuple(out)


def check_stream_options(pipeline: PipelineConfig) -> None:
    """Every stage's chunk options are taken by its model (imports the model classes, so not at
    parse time: tests/config/test_config_resolve.py)."""
    from vllm_omni.model_executor.models.generation_model import GenerationModel
    from vllm_omni.model_executor.models.registry import resolve_stage_model_class

    for stage in pipeline.stages:
        arch = stage.engine_args.model_arch
        if not stage.stream_options or arch is None:  # no model_arch: the worker names that problem
            continue
        model_cls = resolve_stage_model_class(arch, stage.model_stage)
        try:
            if not (isinstance(model_cls, type) and issubclass(model_cls, GenerationModel)):
                raise ValueError("it is not a GenerationModel, so it takes no chunk options")
            model_cls.stream_config(dict(stage.stream_options))
        except ValueError as exc:
            keys = sorted({e.connector for e in pipeline.upstream(stage.stage_id) if e.connector})
            raise ConfigError(f"{model_cls.__name__} (model_stage {stage.model_stage!r}) cannot take these chunk "
                              f"options: {exc}", source=pipeline.source, stage_id=stage.stage_id,
                              field=f"connectors.{'/'.join(keys)}.extra") from None
