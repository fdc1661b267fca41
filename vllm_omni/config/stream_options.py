"""A connector's chunk options reach the decoder stage behind it (docs/streaming.md).

A connector's `extra` holds transport options (TRANSPORT_OPTIONS below) and chunk options
(upstream's `codec_chunk_frames`, ...): the latter configure how the generation stage whose
input edge uses the connector cuts its input into chunks (`StageConfig.stream_options`).

- Parse time (`attach_stream_options`, no imports): each generation stage gets the chunk
  options of the connectors on its input edges. A connector on the edge into an AR stage (as
  upstream's Qwen3-Omni async-chunk config puts them, on thinker -> talker) configures the
  decoders the stream reaches next, where upstream reads them (the talker's chunks into
  code2wav). A connector whose options reach no generation stage, or two connectors that
  disagree on a stage's option, is a ConfigError.
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

# Options of upstream's connectors that are not chunk options of a decoder here: each is ignored
# with its reason (toplevel.read_connectors warns), or refused when its value would change what
# this engine computes (`transport_option_problem`). Every other option of a connector's `extra`
# is a chunk option.
_POLLING = ("stages here are event driven: a stage reads the next chunk when it arrives on its socket (no "
            "polling loop to pace or time out); a request whose upstream stage fails or aborts ends at once")
_DECODER_GRAPHS = "the decoder's CUDA graph and batch sizes are chosen by the engine (enforce_eager turns graphs off)"
_PREDICTOR_GRAPHS = ("the talker's code predictor runs as CUDA graphs, one per batch bucket up to 64 "
                     "(enforce_eager or VLLM_OMNI_PREDICTOR_CUDA_GRAPHS=0 turn them off)")
TRANSPORT_OPTIONS = {
    "shm_threshold_bytes": "the shared-memory threshold is --shm-threshold-bytes, for every edge",
    "codec_streaming": "a streaming edge always carries frame-aligned codec chunks; async_chunk turns streaming "
                       "on and off",
    "connector_get_sleep_s": _POLLING,
    "connector_get_max_wait": _POLLING,
    "connector_get_max_wait_first_chunk": _POLLING,
    "decode_cudagraph_capture_sizes": _DECODER_GRAPHS,
    "decode_cudagraph_batch_sizes": _DECODER_GRAPHS,
    "decode_batch_max_size": _DECODER_GRAPHS,
    "decode_batch_bucket_frames": _DECODER_GRAPHS,
    "decode_compile_shapes": "there is no torch.compile step in the decoder",
    "decode_enable_tf32": "the decoder's math follows the stage's dtype (float32: TF32 off; auto: TF32 on CUDA; "
                          "docs/streaming.md)",
    "code_predictor_prefix_graphs": _PREDICTOR_GRAPHS,
    "code_predictor_prefix_graph_buckets": _PREDICTOR_GRAPHS,
    "code_predictor_prefix_graph_seq_lens": _PREDICTOR_GRAPHS,
    "ref_code_context_frames": "a cloned voice's reference frames are the first chunk's left context, "
                               "codec_left_context_frames of them",
}
_LEFT_CONTEXT, _DEFAULT_LEFT_CONTEXT = "codec_left_context_frames", 25


def transport_option_problem(key: str, extra: dict[str, Any]) -> tuple[str, str] | None:
    """(why, what is allowed) when a transport option's value asks for what this engine does not do."""
    value = extra[key]
    if key == "codec_streaming" and value is not True:
        return ("codec_streaming: false is not supported: a streaming edge always carries frame-aligned codec "
                "chunks", "true, or async_chunk: false to stream nothing")
    left = extra.get(_LEFT_CONTEXT, _DEFAULT_LEFT_CONTEXT)
    if key == "ref_code_context_frames" and value != left:
        return (f"ref_code_context_frames={value} is not supported: a cloned voice's reference reaches the "
                f"decoder as the first chunk's left context, {_LEFT_CONTEXT}={left} frames of it",
                f"{left} (= {_LEFT_CONTEXT}), or leave it out")
    return None


def _options_of(connector: ConnectorConfig) -> dict[str, Any]:
    return {key: value for key, value in connector.extra if key not in TRANSPORT_OPTIONS}


def attach_stream_options(stages: Sequence[StageConfig], edges: Sequence[EdgeConfig],
                          connectors: Sequence[ConnectorConfig], *, source: str) -> tuple[StageConfig, ...]:
    """The stages, each generation stage with the chunk options of the connectors that reach it."""
    decoders = {s.stage_id for s in stages if s.worker_type == WorkerType.GENERATION}
    options_of: dict[int, dict[str, Any]] = {}
    for connector in connectors:
        options = _options_of(connector)
        fed = sorted({e.to_stage for e in edges if e.connector == connector.key})
        if not options or not fed:  # (a connector on no edge changes nothing)
            continue
        targets = _decoders_reached(fed, edges, decoders)
        if not targets:
            option = next(iter(options))
            raise ConfigError(f"is a chunk option of a decoder (generation) stage, and connector {connector.key!r} "
                              f"reaches none: it is on the input edges of stages {', '.join(map(str, fed))}",
                              source=source, field=f"connectors.{connector.key}.extra.{option}",
                              value=options[option], allowed="chunk options on a connector of a stream that "
                                                             "reaches a code2wav stage")
        for stage_id in targets:
            stage_options = options_of.setdefault(stage_id, {})
            for option, value in options.items():
                if stage_options.get(option, value) != value:
                    raise ConfigError(f"the connectors that reach stage {stage_id} disagree on it "
                                      f"({stage_options[option]!r} and {value!r})", source=source,
                                      stage_id=stage_id, field=f"connectors.{connector.key}.extra.{option}",
                                      value=value)
                stage_options[option] = value
    return tuple(replace(s, stream_options=tuple(options_of[s.stage_id].items())) if s.stage_id in options_of else s
                 for s in stages)


def _decoders_reached(fed: Sequence[int], edges: Sequence[EdgeConfig], decoders: set[int]) -> list[int]:
    """The generation stages among `fed`; where a fed stage is not one, the first generation
    stages downstream of it (Qwen3-Omni: thinker -> talker -> code2wav)."""
    found, frontier, seen = set(), list(fed), set()
    while frontier:
        stage_id = frontier.pop()
        if stage_id in seen:
            continue
        seen.add(stage_id)
        if stage_id in decoders:
            found.add(stage_id)
        else:
            frontier.extend(e.to_stage for e in edges if e.from_stage == stage_id)
    return sorted(found)


def check_stream_options(pipeline: PipelineConfig) -> None:
    """Every stage's chunk options are taken by its model (imports the model classes, so not at
    parse time: tests/config/test_config_resolve.py)."""
    from vllm_omni.model_executor.models.registry import resolve_stage_model_class
    from vllm_omni.model_executor.models.stream_options import stream_options_for

    for stage in pipeline.stages:
        arch = stage.engine_args.model_arch
        if not stage.stream_options or arch is None:  # no model_arch: the worker names that problem
            continue
        model_cls = resolve_stage_model_class(arch, stage.model_stage)
        try:
            stream_options_for(model_cls, dict(stage.stream_options))
        except ValueError as exc:
            keys = sorted({e.connector for e in pipeline.upstream(stage.stage_id) if e.connector})
            raise ConfigError(f"{model_cls.__name__} (model_stage {stage.model_stage!r}) cannot take these chunk "
                              f"options: {exc}", source=pipeline.source, stage_id=stage.stage_id,
                              field=f"connectors.{'/'.join(keys)}.extra") from None
