"""Reading YAML strictly: a duplicated key is an error, not "last one wins".

PyYAML silently keeps the last of two equal keys, which would let a typo'd
copy-paste override a setting unnoticed; DESIGN 6 says nothing from outside is
silently ignored.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from vllm_omni.config.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Return the top-level mapping of a YAML file, or raise ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file: {exc.strerror}", source=str(path)) from None
    return load_yaml_text(text, source=str(path))


def load_yaml_text(text: str, *, source: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(f"invalid YAML: {exc.problem or exc.context}", source=where) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source=source) from None
    if not isinstance(data, dict):
        raise ConfigError(f"the file must hold a mapping at the top level, not {type(data).__name__}",
                          source=source)
    return data
