"""Override plumbing shared by the tiny Omni configs (tiny_omni_config.py, tiny_qwen3_omni_config.py)
and the tiny diffusion pipelines (prefixed_overrides).

Both take nested dicts under the HF config's own keys plus prefixed shorthands for one field of
one sub-config, derive the fields the caller did not set, and refuse unknown field names.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# unset(section path, field): True when the caller did not set the field (it may be derived).
Unset = Callable[[tuple[str, ...], str], bool]


def apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any], *, arch: str, top_level_keys: set[str],
                    shorthand_prefixes: Mapping[str, tuple[str, ...]]) -> Unset:
    """Deep-merge the nested overrides (keys in `top_level_keys`) into `cfg`, then set the
    prefixed shorthands; an unknown key raises ValueError. Returns `unset` for `cfg`."""
    nested = {k: v for k, v in overrides.items() if k in top_level_keys}
    explicit: dict[tuple[str, ...], set[str]] = {}  # sections -> fields the caller set
    for key, value in nested.items():
        if isinstance(value, dict):
            for path, fields in _walk_fields((key,), value):
                explicit.setdefault(path, set()).update(fields)
    _deep_merge(cfg, nested)
    for key, value in overrides.items():
        if key in top_level_keys:
            continue
        prefix = next((p for p in shorthand_prefixes if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(
                f"unknown {arch} override {key!r}: use {sorted(top_level_keys)} (nested "
                f"dicts) or a field prefixed with one of {sorted(shorthand_prefixes)}"
            )
        path, field = shorthand_prefixes[prefix], key[len(prefix):]
        section = cfg
        for part in path:
            section = section[part]
        section[field] = copy.deepcopy(value)
        explicit.setdefault(path, set()).add(field)
    return lambda path, field: field not in explicit.get(path, set())


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _walk_fields(path: tuple[str, ...], value: dict[str, Any]):
    """Yield (section path, fields set there) for a nested override dict."""
    leaves = {k for k, v in value.items() if not isinstance(v, dict) or k == "rope_parameters"}
    yield path, leaves
    for k, v in value.items():
        if isinstance(v, dict) and k != "rope_parameters":
            yield from _walk_fields((*path, k), v)


def check_field_names(cfg: dict[str, Any], defaults: dict[str, Any], section_classes: Mapping[tuple[str, ...], str],
                      find_class: Callable[[str], type]) -> None:
    """Refuse fields that neither the section's HF config class declares nor our defaults hold.

    HF configs keep any kwarg as a plain attribute, so a typo would otherwise build the default
    model without a word. The defaults count as known because a few fields are read undeclared.
    Aliases (num_attention_heads for a vision config's num_heads...) are refused: set next to
    the default's real name, which one wins is unclear.
    """
    for path, cls_name in section_classes.items():
        cls = find_class(cls_name)
        if not dataclasses.is_dataclass(cls):  # older config style: nothing to check against
            continue
        section, default = cfg, defaults
        for part in path:
            section, default = section[part], default[part]
        known = {f.name for f in dataclasses.fields(cls)} | set(default)
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} in {'.'.join(path)} ({cls_name})")


def prefixed_overrides(overrides: Mapping[str, Any], defaults: Mapping[str, Mapping[str, Any]],
                       arch: str) -> dict[str, dict[str, Any]]:
    """The tiny diffusion pipelines' overrides: `PREFIXfield=value` sets one constructor kwarg of
    the component whose prefix it has (`transformer_num_layers=3`); unknown keys raise ValueError.
    Returns each prefix's kwargs (its defaults, updated)."""
    parts = {prefix: dict(values) for prefix, values in defaults.items()}
    for key, value in overrides.items():
        prefix = next((p for p in defaults if key.startswith(p)), None)
        field = key[len(prefix):] if prefix else None
        if prefix is None or field not in parts[prefix]:
            known = sorted(p + f for p, fields in defaults.items() for f in fields)
            raise ValueError(f"unknown {arch} override {key!r}; known: {known}")
        parts[prefix][field] = value
    return parts
