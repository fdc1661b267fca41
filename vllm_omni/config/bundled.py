"""Bundled configs and how a model finds its own.

A model's HF `config.json` (model_type, architectures) selects its family record
(model_executor/models/families.py), and the record names the bundled pipelines: the
legacy stage_args YAML under model_executor/stage_configs/ (its topology and defaults)
and the deploy YAML under deploy/ (tuned settings). A plain causal LM has no bundled file
and runs as a one-stage pipeline.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni.config.errors import ConfigError
from vllm_omni.model_executor.models.families import FAMILIES, family_of
from vllm_omni.model_executor.models.family import PipelineVariant

_PACKAGE = Path(__file__).resolve().parent.parent
STAGE_CONFIGS_DIR = _PACKAGE / "model_executor" / "stage_configs"
DIFFUSERS_INDEX = "model_index.json"  # a diffusers pipeline folder's config
DEPLOY_DIR = _PACKAGE / "deploy"


@dataclass(frozen=True)
class BundledPipeline:
    name: str  # e.g. "qwen2_5_omni"; also the file stem in both directories

    @property
    def legacy_path(self) -> Path:
        return STAGE_CONFIGS_DIR / f"{self.name}.yaml"

    @property
    def deploy_path(self) -> Path:
        return DEPLOY_DIR / f"{self.name}.yaml"


BUNDLED_PIPELINES = tuple(name for family in FAMILIES for name in family.pipelines.values())
# Upstream's pipeline registry keys that name one of ours (the family records' upstream_pipelines).
PIPELINE_ALIASES = {alias: name for family in FAMILIES for alias, name in family.upstream_pipelines.items()}
# Architectures that run as one AR stage: the usual HF names of plain decoders.
_PLAIN_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_bundled_pipeline(name: str) -> bool:
    return name in BUNDLED_PIPELINES or name in PIPELINE_ALIASES


def bundled_pipeline(name: str) -> BundledPipeline:
    """A bundled pipeline by its name or upstream's name for it."""
    if not is_bundled_pipeline(name):
        raise ConfigError("unknown bundled pipeline", field="pipeline", value=name,
                          allowed=" | ".join(BUNDLED_PIPELINES) + " | a path to a stage_args YAML")
    return BundledPipeline(PIPELINE_ALIASES.get(name, name))


def read_hf_config(model: str | os.PathLike) -> dict[str, Any]:
    """config.json of a local model directory, a config.json path, or a cached HF hub id.
    Nothing is downloaded: a model that is not on disk is an error. A diffusers pipeline
    folder has model_index.json instead: its `_class_name` is the architecture."""
    path = Path(model).expanduser()
    candidates = [path] if path.is_file() else [path / "config.json", path / DIFFUSERS_INDEX]
    if not path.exists() and "/" in str(model) and not str(model).startswith(("/", ".")):
        candidates += _hub_cache_candidates(str(model))
    for candidate in candidates:
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read model config: {exc}", source=str(candidate)) from None
            if not isinstance(data, dict):
                raise ConfigError("model config is not a JSON object", source=str(candidate))
            if candidate.name == DIFFUSERS_INDEX:
                return {**data, "architectures": [data.get("_class_name")]}
            return data
    raise ConfigError("no config.json found (not a local model directory and not in the Hugging Face "
                      "cache)", field="model", value=str(model),
                      allowed="a local model directory, or pass a stage config file")


def _hub_cache_candidates(repo_id: str) -> list[Path]:
    root = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    repo = Path(root) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return [snapshot / "config.json", snapshot / DIFFUSERS_INDEX]
    return sorted(p for name in ("config.json", DIFFUSERS_INDEX)
                  for p in (repo / "snapshots").glob(f"*/{name}")) if repo.is_dir() else []


def _as_hf_dict(model_dir_or_hf_config: Any) -> Mapping[str, Any]:
    if isinstance(model_dir_or_hf_config, Mapping):
        return model_dir_or_hf_config
    if isinstance(model_dir_or_hf_config, (str, os.PathLike)):
        return read_hf_config(model_dir_or_hf_config)
    # A transformers PretrainedConfig (or anything shaped like one).
    return {"model_type": getattr(model_dir_or_hf_config, "model_type", None),
            "architectures": getattr(model_dir_or_hf_config, "architectures", None) or [],
            "enable_audio_output": getattr(model_dir_or_hf_config, "enable_audio_output", None)}


def pipeline_for_model(model_dir_or_hf_config: Any, *, audio_output: bool | None = None,
                       num_devices: int | None = None) -> BundledPipeline | None:
    """The bundled pipeline for a model, or None for a plain LM. Other models are an error:
    running a TTS or diffusion model as a one-stage LM would fail far from the cause.

    audio_output=False (or a config with enable_audio_output: false) picks the text-only
    variant; num_devices=1 (one visible GPU) the single-device one, where they exist."""
    hf = _as_hf_dict(model_dir_or_hf_config)
    family = family_of(hf)
    if family is not None and family.pipelines:
        variant = PipelineVariant.DEFAULT
        if audio_output is False or hf.get("enable_audio_output") is False or family.checkpoint_stage(hf):
            variant = PipelineVariant.TEXT_ONLY
        elif num_devices == 1:
            variant = PipelineVariant.SINGLE_DEVICE
        return BundledPipeline(family.pipelines.get(variant, family.pipelines[PipelineVariant.DEFAULT]))
    archs = list(hf.get("architectures") or [])
    if family is not None or any(a.endswith(_PLAIN_LM_SUFFIXES) for a in archs):
        return None
    known = sorted(t for f in FAMILIES if f.pipelines for t in f.model_types)
    raise ConfigError(f"no bundled stage config for model_type={hf.get('model_type')!r}, architectures={archs}",
                      field="model", allowed="model types " + ", ".join(known)
                      + ", a causal LM (one stage), or pass --stage-configs-path / --deploy-config")


def checkpoint_variant(named: BundledPipeline, model: Any) -> BundledPipeline:
    """A family's default pipeline, named in a deploy file, as `model` can run it: its text-only
    variant for a checkpoint without audio output (a Thinking one), as upstream's registry
    resolves it from the HF config. Any other name is taken as written."""
    if model is None:
        return named
    hf = _as_hf_dict(model)
    family = family_of(hf)
    if family is None or family.pipelines.get(PipelineVariant.DEFAULT) != named.name \
            or PipelineVariant.TEXT_ONLY not in family.pipelines:
        return named
    if hf.get("enable_audio_output") is False or family.checkpoint_stage(hf):
        return BundledPipeline(family.pipelines[PipelineVariant.TEXT_ONLY])
    return named


def find_bundled_config(model_dir_or_hf_config: Any, *, kind: str = "legacy") -> Path | None:
    """Path of the bundled YAML (`kind` "legacy" or "deploy") for a model, None for a plain LM."""
    pipeline = pipeline_for_model(model_dir_or_hf_config)
    if pipeline is None:
        return None
    return pipeline.legacy_path if kind == "legacy" else pipeline.deploy_path


def model_architecture(model_dir_or_hf_config: Any) -> str | None:
    archs = list(_as_hf_dict(model_dir_or_hf_config).get("architectures") or [])
    return archs[0] if archs else None
