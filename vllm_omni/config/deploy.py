"""Deploy configs (spec 001, `--deploy-config`): settings layered on a pipeline.

Schema of one file (every key optional):

    base_config: parent.yaml     # overlay parent: relative to this file, else a bundled name
    pipeline: qwen2_5_omni       # bundled pipeline name, or a path to a stage_args YAML
    async_chunk: true
    trust_remote_code / dtype / enable_prefix_caching / enable_chunked_prefill  # every stage
    connectors: {<key>: {name: SharedMemoryConnector, extra: {...}}}
    runtime: {defaults: {window_size, max_inflight}, edges: [...]}   # or top-level `edges:`
    stages:                      # per stage, flat keys, matched by stage_id
      - stage_id: 0
        devices: "0"
        gpu_memory_utilization: 0.8
        default_sampling_params: {...}
        input_connectors: {from_stage_0: <key>}
    platforms:                   # deltas applied on top of `stages:` on that platform
      rocm: {stages: [...]}      # (only the current platform's section is read in full)

Upstream's other top-level keys (session_mode, quantization, ...) are decided by upstream_keys.

Overlays merge stage by stage and key by key (the child wins); the topology
(which stages exist and how they connect) comes only from the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni.config import toplevel, upstream_keys
from vllm_omni.config.bundled import DEPLOY_DIR
from vllm_omni.config.errors import ConfigError, unknown_keys
from vllm_omni.config.layers import Layer, check_field, read_stage_list
from vllm_omni.config.upstream_keys import IGNORED_PREFIX
from vllm_omni.config.yaml_io import load_yaml_file

PLATFORMS = ("cuda", "rocm", "npu", "xpu", "cpu")  # where this build may run (`platform=`)
# Section names of upstream deploy files: the platforms above and others upstream supports.
PLATFORM_SECTIONS = (*PLATFORMS, "hpu", "musa", "tpu")
# Deploy keys that apply to every stage (upstream calls them pipeline-wide).
PIPELINE_WIDE = ("trust_remote_code", "dtype", "enable_prefix_caching", "enable_chunked_prefill")
DEPLOY_KEYS = ("base_config", "pipeline", "async_chunk", "connectors", "runtime", "edges", "stages",
               "platforms", *PIPELINE_WIDE)


@dataclass
class DeployChain:
    files: list[Path]  # the base first, the user's file last
    layers: list[Layer]  # in precedence order, lowest first; platform deltas last
    pipeline: str | None  # the `pipeline:` value nearest the user's file
    pipeline_file: Path | None  # the file that set it, for relative paths and messages


def is_deploy_data(data: dict[str, Any]) -> bool:
    return "stage_args" not in data and any(k in data for k in ("stages", "base_config", "pipeline", "platforms"))


def read_deploy_chain(path: Path, data: dict[str, Any] | None = None, *, platform: str) -> DeployChain:
    if platform not in PLATFORMS:
        raise ConfigError("unknown platform", field="platform", value=platform, allowed=" | ".join(PLATFORMS))
    chain: list[tuple[Path, dict[str, Any]]] = []
    current, current_data = path.resolve(), data
    while True:
        if current in [p for p, _ in chain]:
            loop = " -> ".join(str(p) for p, _ in chain + [(current, None)])
            raise ConfigError(f"base_config forms a cycle: {loop}", source=str(path), field="base_config")
        current_data = current_data if current_data is not None else load_yaml_file(current)
        _check_top_keys(current_data, source=str(current))
        chain.append((current, current_data))
        parent = current_data.get("base_config")
        if parent is None:
            break
        current, current_data = _resolve_base(parent, current), None
    chain.reverse()
    layers = [_file_layer(p, d) for p, d in chain]
    layers += [layer for p, d in chain if (layer := _platform_layer(p, d, platform)) is not None]
    pipeline, pipeline_file = None, None
    for p, d in chain:
        if "pipeline" in d:
            pipeline, pipeline_file = d["pipeline"], p
    return DeployChain([p for p, _ in chain], layers, pipeline, pipeline_file)


def _check_top_keys(data: dict[str, Any], *, source: str) -> None:
    if "stage_args" in data:
        raise ConfigError("is a legacy stage_args config, not a deploy config (pass it with "
                          "--stage-configs-path, or name it in `pipeline:`)", source=source)
    if unknown := [k for k in data if k not in DEPLOY_KEYS and not upstream_keys.is_policy_key(k)]:
        raise unknown_keys(unknown, DEPLOY_KEYS, source=source)
    if "edges" in data and isinstance(data.get("runtime"), dict) and "edges" in data["runtime"]:
        raise ConfigError("edges are given twice (top-level `edges:` and `runtime.edges`)", source=source,
                          field="edges", allowed="one of them")
    for key in ("base_config", "pipeline"):
        if key in data and not (isinstance(data[key], str) and data[key].strip()):
            raise ConfigError("must be a non-empty string", source=source, field=key, value=data[key])


def _resolve_base(name: str, child: Path) -> Path:
    """Relative to the child file first, then among the bundled deploy configs: by name, or by the
    file name of a path into upstream's package (`../../vllm_omni/deploy/qwen3_omni_moe.yaml` in
    its CI files) when no such file is there."""
    candidates = [Path(name).expanduser()] if Path(name).is_absolute() else [
        child.parent / name, DEPLOY_DIR / name]
    if "/" in name and (DEPLOY_DIR / Path(name).name).is_file():
        candidates.append(DEPLOY_DIR / Path(name).name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError("file not found (looked in " + ", ".join(str(c) for c in candidates) + ")",
                      source=str(child), field="base_config", value=name)


def _file_layer(path: Path, data: dict[str, Any]) -> Layer:
    source = str(path)
    layer = Layer(source=source)
    if "stages" in data:
        layer.stages = read_stage_list(data["stages"], source=source, section="stages", style="deploy")
    for key in PIPELINE_WIDE:
        if key in data:
            layer.every_stage[f"engine_args.{key}"] = check_field(
                f"engine_args.{key}", data[key], source=source, stage_id=None, shown=key)
    if "async_chunk" in data:
        layer.top.update(toplevel.read_async_chunk(data["async_chunk"], source=source))
    if "runtime" in data:
        layer.top.update(toplevel.read_runtime(data["runtime"], source=source))
    if "edges" in data:
        layer.top["runtime.edges"] = toplevel.read_edges(data["edges"], source=source, section="edges")
    if "connectors" in data:
        layer.top.update(toplevel.read_connectors(data["connectors"], source=source))
    for key in [k for k in data if k not in DEPLOY_KEYS]:  # upstream keys without a schema field here
        reason = upstream_keys.apply_policy(key, data[key], source=source, stage_id=None, field=key)
        if reason is not None:
            layer.top[f"{IGNORED_PREFIX}{key}"] = reason
    return layer


def _platform_layer(path: Path, data: dict[str, Any], platform: str) -> Layer | None:
    """Only the current platform's section is read against the schema and becomes a layer;
    the others are checked for their shape alone, so that a key only another platform's
    engine knows (say an NPU option) never blocks a CUDA user."""
    sections = data.get("platforms")
    if sections is None:
        return None
    if not isinstance(sections, dict):
        raise ConfigError("must be a mapping of platform -> {stages: [...]}", source=str(path),
                          field="platforms", value=sections)
    if unknown := [k for k in sections if k not in PLATFORM_SECTIONS]:
        raise unknown_keys(unknown, PLATFORM_SECTIONS, source=str(path), section="platforms")
    chosen = None
    for name, section in sections.items():
        where = f"platforms.{name}"
        if not isinstance(section, dict):
            raise ConfigError("must be a mapping {stages: [...]}", source=str(path), field=where, value=section)
        if unknown := [k for k in section if k not in ("stages", "model_runner")]:
            raise unknown_keys(unknown, ("stages", "model_runner"), source=str(path), section=where)
        source = f"{path} ({where})"
        if name != platform:
            _check_stage_list_shape(section.get("stages", []), source=source, section=f"{where}.stages")
            continue
        chosen = Layer(source=source, stages=read_stage_list(section.get("stages", []), source=source,
                                                            section=f"{where}.stages", style="deploy"))
        if "model_runner" in section:
            chosen.top[f"{IGNORED_PREFIX}{where}.model_runner"] = upstream_keys.IGNORED_ENGINE_ARGS["model_runner"]
    return chosen


def _check_stage_list_shape(entries: Any, *, source: str, section: str) -> None:
    if not isinstance(entries, list):
        raise ConfigError("must be a list of stage entries", source=source, field=section, value=entries)
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("stage_id"), int):
            raise ConfigError("must be a mapping with an integer stage_id", source=source,
                              field=f"{section}[{index}]", value=entry)
