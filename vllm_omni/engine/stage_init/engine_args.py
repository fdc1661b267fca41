"""The normalized per-stage engine args dict and the KV transfer info it carries (spec 002).

These build upstream's inputs to vLLM's engine (`build_engine_args_dict`, `resolve_worker_cls`,
`inject_kv_stage_info`, `get_stage_connector_spec`) from upstream-shaped configs (read with
`readers.foreign_field`). Our workers build their engines from the frozen `StageConfig` directly
(`worker/gpu_ar_worker.engine_config_kwargs`, the generation and diffusion workers), so the
runtime does not call them; `apply_cli_tokenizer`'s rule is applied by the config layer, to the
frozen config (config/overrides.py)."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from vllm_omni.engine.stage_init.devices import get_stage_tp_size
from vllm_omni.engine.stage_init.readers import as_dict, foreign_field, stage_type_of

logger = logging.getLogger(__name__)

AR_WORKER_CLS = "vllm_omni.worker.gpu_ar_worker.GPUARWorker"
GENERATION_WORKER_CLS = "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"
_WORKER_CLS_BY_TYPE = {"ar": AR_WORKER_CLS, "generation": GENERATION_WORKER_CLS}


def resolve_worker_cls(engine_args: MutableMapping[str, Any]) -> None:
    """Fill ``worker_cls`` from ``worker_type`` (ar / generation) unless set explicitly."""
    worker_type = engine_args.get("worker_type")
    if not worker_type or engine_args.get("worker_cls") not in (None, "", "auto"):
        return
    key = str(getattr(worker_type, "value", worker_type)).lower()
    if key not in _WORKER_CLS_BY_TYPE:
        raise ValueError(
            f"engine_args.worker_type={worker_type!r} is invalid: must be one of {sorted(_WORKER_CLS_BY_TYPE)}"
        )
    engine_args["worker_cls"] = _WORKER_CLS_BY_TYPE[key]


def apply_cli_tokenizer(
    engine_args: MutableMapping[str, Any],
    *,
    cli_tokenizer: str | None,
    stage_defines_tokenizer: bool,
) -> None:
    """Forward the CLI ``--tokenizer`` unless the stage config defines its own."""
    if cli_tokenizer is not None and not stage_defines_tokenizer:
        engine_args["tokenizer"] = cli_tokenizer


def get_stage_connector_spec(omni_transfer_config: Any, stage_id: int, async_chunk: bool) -> dict[str, Any]:
    """The connector spec of the first edge into ``stage_id`` when async chunking is on.

    ``omni_transfer_config.connectors`` (attribute or key) maps
    ``(from_stage, to_stage)`` to a spec with ``name`` and ``extra`` (object
    or dict). Returns ``{"name": ..., "extra": {...}}``, or ``{}`` when async
    chunking is off or no edge reaches the stage.
    """
    if not async_chunk or omni_transfer_config is None:
        return {}
    connectors = foreign_field(omni_transfer_config, "connectors") or {}
    for (_src, dst), spec in connectors.items():
        if str(dst) == str(stage_id):
            return {"name": foreign_field(spec, "name"), "extra": dict(foreign_field(spec, "extra") or {})}
    return {}


def build_engine_args_dict(
    stage_config: Any,
    model: str,
    stage_connector_spec: dict[str, Any] | None = None,
    cli_tokenizer: str | None = None,
) -> dict[str, Any]:
    """The normalized engine args dict for one stage (a detached copy).

    Sets ``model`` and ``stage_id`` (the stage's own, never an inherited CLI
    value), resolves ``worker_cls`` for non-diffusion stages, forwards the CLI
    tokenizer when the stage has none, and attaches ``stage_connector_spec``
    when given. A None ``tensor_parallel_size`` is dropped so the engine's
    default applies.
    """
    engine_args = as_dict(foreign_field(stage_config, "engine_args"))
    if "tensor_parallel_size" in engine_args and engine_args["tensor_parallel_size"] is None:
        del engine_args["tensor_parallel_size"]
    apply_cli_tokenizer(
        engine_args,
        cli_tokenizer=cli_tokenizer,
        stage_defines_tokenizer=engine_args.get("tokenizer") is not None,
    )
    engine_args["model"] = model
    engine_args["stage_id"] = foreign_field(stage_config, "stage_id")
    if stage_type_of(stage_config) != "diffusion":
        resolve_worker_cls(engine_args)
    if stage_connector_spec is not None:
        engine_args["stage_connector_spec"] = dict(stage_connector_spec)
    return engine_args


def _find_stage(stage_configs: Sequence[Any], stage_id: Any) -> Any | None:
    for cfg in stage_configs:
        if str(foreign_field(cfg, "stage_id")) == str(stage_id):
            return cfg
    return None


def inject_kv_stage_info(
    stage_cfg: Any,
    stage_id: int,
    stage_configs: Sequence[Any] | None = None,
) -> dict[str, Any] | None:
    """Fill ``engine_args.omni_kv_config`` with this stage's identity and TP topology.

    Adds (without overriding user-authored values) ``stage_id``,
    ``engine_input_source`` and, when ``stage_configs`` is given,
    ``rank_mapping.from_tp`` / ``rank_mapping.to_tp`` from the sending and the
    receiving stage's TP sizes, so heterogeneous TP needs no hand-written
    rank mapping. The peer is ``omni_from_stage`` / ``omni_to_stage`` when the
    config names this stage as one end, else the first ``engine_input_source``.

    Returns the filled dict, or None when the stage has no ``omni_kv_config``.
    A mutable dict is filled in place; anything else (a frozen config, a
    read-only mapping) is copied, written back where the engine args allow it,
    and the caller must use the returned dict.
    """
    engine_args = foreign_field(stage_cfg, "engine_args")
    kv = foreign_field(engine_args, "omni_kv_config")
    if kv is None:
        return None
    target = kv if isinstance(kv, MutableMapping) else as_dict(kv)
    target.setdefault("stage_id", stage_id)
    sources = [int(s) for s in (foreign_field(stage_cfg, "engine_input_source") or [])]
    if sources:
        target.setdefault("engine_input_source", sources)
    if stage_configs:
        _infer_tp_topology(target, stage_cfg, stage_id, sources, stage_configs)
    if target is not kv:
        _write_back(engine_args, target, stage_id)
    return target


def _infer_tp_topology(kv: MutableMapping[str, Any], stage_cfg: Any, stage_id: int, sources: list[int],
                       stage_configs: Sequence[Any]) -> None:
    own_tp = get_stage_tp_size(stage_cfg)
    from_stage, to_stage = kv.get("omni_from_stage"), kv.get("omni_to_stage")
    if from_stage is not None and str(from_stage) == str(stage_id):
        peer, from_is_peer = to_stage, False
    elif to_stage is not None and str(to_stage) == str(stage_id):
        peer, from_is_peer = from_stage, True
    elif sources:
        peer, from_is_peer = sources[0], True
    else:
        return
    peer_cfg = None if peer is None else _find_stage(stage_configs, peer)
    if peer_cfg is None:
        return
    peer_tp = get_stage_tp_size(peer_cfg)
    rank_mapping = kv.get("rank_mapping")
    rank_mapping = dict(rank_mapping) if isinstance(rank_mapping, Mapping) else {}
    rank_mapping.setdefault("from_tp", peer_tp if from_is_peer else own_tp)
    rank_mapping.setdefault("to_tp", own_tp if from_is_peer else peer_tp)
    kv["rank_mapping"] = rank_mapping


def _write_back(engine_args: Any, kv: dict[str, Any], stage_id: int) -> None:
    if isinstance(engine_args, MutableMapping):
        engine_args["omni_kv_config"] = kv
        return
    try:
        setattr(engine_args, "omni_kv_config", kv)
    except (AttributeError, dataclasses.FrozenInstanceError):
        logger.debug("Stage %s: engine args are frozen; omni_kv_config returned, not stored", stage_id)
