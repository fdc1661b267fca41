"""The one error type of the config edge.

Every problem found while reading a stage config (YAML, deploy overlays, CLI
flags, --stage-overrides JSON) is raised as a ConfigError whose message names
where the value came from (file or flag), the stage, the field, the bad value
and what is allowed, so a user can fix it without reading our code.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_UNSET: Any = object()


class BadValue(Exception):
    """Raised by a field validator; the caller adds file/stage/field context."""

    def __init__(self, allowed: str, problem: str | None = None) -> None:
        super().__init__(problem or allowed)
        self.allowed = allowed
        self.problem = problem


class ConfigError(ValueError):
    def __init__(
        self,
        problem: str,
        *,
        source: str | None = None,
        stage_id: int | None = None,
        field: str | None = None,
        value: Any = _UNSET,
        allowed: str | None = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.stage_id = stage_id
        self.field = field
        self.value = None if value is _UNSET else value
        self.allowed = allowed
        super().__init__(_format(problem, source, stage_id, field, value, allowed))


def _format(problem: str, source: str | None, stage_id: int | None, field: str | None,
            value: Any, allowed: str | None) -> str:
    parts = []
    if source:
        parts.append(source)
    if stage_id is not None:
        parts.append(f"stage {stage_id}")
    if field:
        parts.append(field if value is _UNSET else f"{field}={value!r}")
    text = ": ".join(parts + [problem])
    if allowed:
        text += f"; allowed: {allowed}"
    return text


def bad_value(exc: BadValue, *, source: str | None, stage_id: int | None, field: str,
              value: Any) -> ConfigError:
    return ConfigError(exc.problem or "invalid value", source=source, stage_id=stage_id,
                       field=field, value=value, allowed=exc.allowed)


def unknown_keys(keys: Iterable[str], allowed: Iterable[str], *, source: str | None,
                 stage_id: int | None = None, section: str | None = None) -> ConfigError:
    """An unknown key is always an error (DESIGN 6); suggest the closest known key."""
    keys = sorted(str(k) for k in keys)
    allowed = sorted(allowed)
    hints = []
    for key in keys:
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hints.append(f"{key!r} -> did you mean {close[0]!r}?")
    problem = f"unknown key{'s' if len(keys) > 1 else ''} {', '.join(repr(k) for k in keys)}"
    if hints:
        problem += f" ({'; '.join(hints)})"
    return ConfigError(problem, source=source, stage_id=stage_id, field=section,
                       allowed=", ".join(allowed))
