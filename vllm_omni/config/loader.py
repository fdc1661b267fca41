"""Entry point of the config edge: files, flags and JSON in, one PipelineConfig out.

Precedence, highest first (DESIGN 6):
    --stage-overrides JSON > explicit CLI flags > platform deltas
    > the user's YAML (base_config overlays resolved) > bundled defaults > documented defaults

- A legacy stage_args YAML (spec 000) is complete: it is the user's YAML layer
  over the documented defaults.
- A deploy YAML (spec 001) overlays a pipeline: its `pipeline:` key, else the
  bundled pipeline found from --model. The pipeline's stage_args YAML is the
  "bundled defaults" layer and fixes the topology.
- No file: the model's bundled deploy YAML over its bundled pipeline, or a
  one-stage pipeline for a plain causal LM; then the checkpoint's own deploy settings, if its
  folder has them (checkpoint_deploy.py). The bundled pipeline has variants: text only
  when `output_modalities` leaves audio out (or the checkpoint has no audio output), one
  device when only one GPU is visible.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from vllm_omni.config import bundled, toplevel
from vllm_omni.config.build import build_pipeline
from vllm_omni.config.checkpoint_deploy import checkpoint_deploy_layers
from vllm_omni.config.deploy import DeployChain, is_deploy_data, read_deploy_chain
from vllm_omni.config.errors import ConfigError, unknown_keys
from vllm_omni.config.layers import Layer, read_stage_fields, read_stage_list
from vllm_omni.config.overrides import cli_flags_layer, parse_stage_overrides
from vllm_omni.config.stage_config import ConfigFormat, PipelineConfig
from vllm_omni.config.strategy import is_strategy_data, strategy_layer
from vllm_omni.config.upstream_keys import FORCED_ALIGNER, FORCED_ALIGNER_REASON
from vllm_omni.config.yaml_io import load_yaml_file

logger = logging.getLogger(__name__)

LEGACY_KEYS = ("stage_args", "runtime", "connectors", "async_chunk")
ModelRef = str | os.PathLike | Mapping[str, Any] | None


def load_pipeline_config(
    path: str | os.PathLike | None = None,
    *,
    model: ModelRef = None,
    expected_format: Literal["legacy", "deploy"] | None = None,
    stage_overrides: str | Mapping[Any, Any] | None = None,
    cli_args: Mapping[str, Any] | None = None,
    cli_stage_id: int | None = None,
    async_chunk: bool | None = None,
    platform: str = "cuda",
    output_modalities: Sequence[str] | None = None,
    check_devices: bool = False,
    strategy_config: str | os.PathLike | None = None,
) -> PipelineConfig:
    """Read, merge and validate everything; raise ConfigError on the first problem.

    path: a legacy or deploy YAML (detected from its keys); None: the model's bundled config.
    model: model directory / cached hub id / HF config dict, for bundled lookup.
    expected_format: "legacy" for --stage-configs-path, "deploy" for --deploy-config.
    cli_args: explicitly given engine flags (None values are skipped); cli_stage_id limits
    them to one stage. async_chunk: --async-chunk / --no-async-chunk (None: keep the YAML's).
    output_modalities: what the caller will ever ask for (picks a bundled variant; no effect on a file).
    check_devices: `platform` is this machine's: every runtime.devices index must exist on it.
    strategy_config: upstream's parallel strategy file (config/strategy.py), over the files.
    Keys the files set that have no effect here are logged in one warning (`PipelineConfig.ignored`).
    """
    if path is None:
        audio = None if output_modalities is None else "audio" in output_modalities
        layers, fmt, source, name = _bundled_layers(model, platform, audio, visible_device_count(platform))
    else:
        layers, fmt, source, name = _file_layers(Path(path), model, expected_format, platform)
    if strategy_config is not None:
        layers.append(strategy_layer(strategy_config, next(layer for layer in layers if layer.defines_topology)))
    layers.append(cli_flags_layer(cli_args, stage_id=cli_stage_id))
    layers.append(parse_stage_overrides(stage_overrides))
    if async_chunk is not None:
        layers.append(Layer(source="--async-chunk/--no-async-chunk", top={"async_chunk": async_chunk}))
    pipeline = build_pipeline(layers, fmt=fmt, source=source, pipeline_name=name,
                              default_async_chunk=fmt is ConfigFormat.DEPLOY,
                              num_devices=visible_device_count(platform) if check_devices else None)
    if pipeline.ignored:
        logger.warning("%s: these settings have no effect on this engine and are ignored:\n  %s", source,
                       "\n  ".join(i.describe() for i in pipeline.ignored))
    return pipeline


def load_stage_configs_from_yaml(path: str | os.PathLike) -> PipelineConfig:
    """A stage config file on its own (upstream's name for it)."""
    return load_pipeline_config(path)


def single_stage_pipeline(model: ModelRef = None) -> PipelineConfig:
    """A plain LLM checkpoint: one AR stage that returns text."""
    return build_pipeline([_single_stage_layer(model)], fmt=ConfigFormat.SINGLE_STAGE,
                          source=_single_stage_source(model))


def detect_platform() -> str:
    """The accelerator platform whose `platforms:` delta applies (imports torch)."""
    import torch

    if getattr(torch.version, "hip", None):
        return "rocm"
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _file_layers(path: Path, model: ModelRef, expected: str | None, platform: str):
    data = load_yaml_file(path)
    source = str(path)
    if "stage_args" in data and "stages" in data:
        raise ConfigError("has both `stage_args:` (legacy format) and `stages:` (deploy format)",
                          source=source, allowed="one format per file")
    if "stage_args" in data:
        if expected == "deploy":
            raise ConfigError("is a legacy stage_args config; pass it with --stage-configs-path", source=source)
        return [legacy_layer(data, source=source)], ConfigFormat.LEGACY, source, None
    if FORCED_ALIGNER in data and not is_deploy_data(data):
        raise ConfigError(f"is upstream's forced-aligner settings file (`{FORCED_ALIGNER}:`, its "
                          f"--forced-aligner-config): {FORCED_ALIGNER_REASON}", source=source)
    if is_strategy_data(data):
        raise ConfigError("is upstream's parallel strategy file (`strategies:`), the companion of a stage or "
                          "deploy config: pass it with --strategy-config next to that config", source=source)
    if not is_deploy_data(data):
        raise ConfigError("cannot tell the config format: top-level keys " + ", ".join(map(repr, data)),
                          source=source, allowed="a legacy config with `stage_args:`, a deploy config with "
                                                 "`stages:`, `base_config:` or `pipeline:`, or a strategy file "
                                                 "with `strategies:` (--strategy-config)")
    if expected == "legacy":
        raise ConfigError("is a deploy config; pass it with --deploy-config", source=source)
    chain = read_deploy_chain(path, data, platform=platform)
    topo, name = _deploy_topology(chain, model)
    return [topo, *chain.layers], ConfigFormat.DEPLOY, source, name


def visible_device_count(platform: str) -> int | None:
    """GPUs this process sees on `platform` (None: not counted, e.g. the CPU)."""
    if platform != "cuda":
        return None
    import torch

    return torch.cuda.device_count()  # asks the driver; creates no CUDA context


def _bundled_layers(model: ModelRef, platform: str, audio_output: bool | None, num_devices: int | None):
    if model is None:
        raise ConfigError("no stage config given and no model to find a bundled one for",
                          allowed="a config file path or --model")
    pipeline = bundled.pipeline_for_model(model, audio_output=audio_output, num_devices=num_devices)
    if pipeline is None:
        topo = _single_stage_layer(model)
        return ([topo, *checkpoint_deploy_layers(model, platform, topo.stages)], ConfigFormat.SINGLE_STAGE,
                _single_stage_source(model), None)
    topo = _legacy_file_layer(pipeline.legacy_path, bundled_default=True)
    own = checkpoint_deploy_layers(model, platform, topo.stages)  # the checkpoint's own settings, over the bundled ones
    if not pipeline.deploy_path.is_file():
        return [topo, *own], ConfigFormat.LEGACY, str(pipeline.legacy_path), pipeline.name
    chain = read_deploy_chain(pipeline.deploy_path, platform=platform)
    return [topo, *chain.layers, *own], ConfigFormat.DEPLOY, str(pipeline.deploy_path), pipeline.name


def _deploy_topology(chain: DeployChain, model: ModelRef) -> tuple[Layer, str | None]:
    """The pipeline a deploy chain overlays: `pipeline:` (a bundled name or a stage_args
    YAML path), else the bundled pipeline of --model."""
    if chain.pipeline is not None:
        if bundled.is_bundled_pipeline(chain.pipeline):
            pipeline = bundled.checkpoint_variant(bundled.bundled_pipeline(chain.pipeline), model)
            return _legacy_file_layer(pipeline.legacy_path, bundled_default=True), pipeline.name
        candidate = Path(chain.pipeline).expanduser()
        if not candidate.is_absolute():
            candidate = chain.pipeline_file.parent / candidate
        if not candidate.is_file():
            raise ConfigError("is neither a bundled pipeline nor an existing stage_args YAML",
                              source=str(chain.pipeline_file), field="pipeline", value=chain.pipeline,
                              allowed=" | ".join(bundled.BUNDLED_PIPELINES) + " | a path to a stage_args YAML")
        return _legacy_file_layer(candidate, bundled_default=False), None
    if model is None:
        raise ConfigError("a deploy config needs a pipeline: set `pipeline:` in the file or pass --model",
                          source=str(chain.files[-1]), field="pipeline",
                          allowed=" | ".join(bundled.BUNDLED_PIPELINES))
    pipeline = bundled.pipeline_for_model(model)
    if pipeline is None:
        return _single_stage_layer(model), None
    return _legacy_file_layer(pipeline.legacy_path, bundled_default=True), pipeline.name


def _legacy_file_layer(path: Path, *, bundled_default: bool) -> Layer:
    source = f"{path} (bundled)" if bundled_default else str(path)
    return legacy_layer(load_yaml_file(path), source=source)


def legacy_layer(data: dict[str, Any], *, source: str) -> Layer:
    """A spec 000 file: `stage_args` plus optional top-level runtime / connectors / async_chunk."""
    if unknown := [k for k in data if k not in LEGACY_KEYS]:
        raise unknown_keys(unknown, LEGACY_KEYS, source=source)
    layer = Layer(source=source, defines_topology=True)
    layer.stages = read_stage_list(data["stage_args"], source=source, section="stage_args", style="legacy")
    if "connectors" in data and isinstance(data.get("runtime"), dict) and "connectors" in data["runtime"]:
        raise ConfigError("connectors are given twice (top-level `connectors:` and `runtime.connectors`)",
                          source=source, field="connectors", allowed="one of them")
    if "runtime" in data:
        layer.top.update(toplevel.read_runtime(data["runtime"], source=source))
    if "connectors" in data:
        layer.top.update(toplevel.read_connectors(data["connectors"], source=source))
    if "async_chunk" in data:
        layer.top.update(toplevel.read_async_chunk(data["async_chunk"], source=source))
    return layer


def _single_stage_source(model: ModelRef) -> str:
    return f"one-stage pipeline for {model if isinstance(model, (str, os.PathLike)) else 'a plain LM'}"


def _single_stage_layer(model: ModelRef) -> Layer:
    arch = bundled.model_architecture(model) if model is not None else None
    entry = {
        "engine_args": {"model_arch": arch, "worker_type": "ar", "engine_output_type": "text",
                        # Plain text output has no hidden states, so prefix caching is safe (spec 000).
                        "enable_prefix_caching": True},
        "final_output": True, "final_output_type": "text", "is_comprehension": True,
        # No repetition penalty for a plain LM: greedy output then matches vLLM and HF.
        "default_sampling_params": {"repetition_penalty": 1.0},
    }
    source = _single_stage_source(model)
    return Layer(source=source, defines_topology=True,
                 stages={0: read_stage_fields(entry, source=source, stage_id=0, style="legacy")})
