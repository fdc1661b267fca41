"""Pipeline-level YAML sections shared by both formats: `runtime:` (spec 000:
defaults.window_size, defaults.max_inflight, edges), `connectors:` and `async_chunk`.

Values are returned as {pipeline path: value} for a Layer's `top` map.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from vllm_omni.config import schema
from vllm_omni.config.errors import BadValue, ConfigError, bad_value, unknown_keys
from vllm_omni.config.stage_config import ConnectorConfig
from vllm_omni.config.stream_options import TRANSPORT_OPTIONS, transport_option_problem
from vllm_omni.config.upstream_keys import IGNORED_PREFIX

# The connector class our transport is: stages on one host exchange ZMQ messages whose large
# tensors travel through shared memory. Every other upstream connector is refused by name.
SHM_CONNECTOR = "SharedMemoryConnector"

check_window = schema.check_int(1, extra=(-1,))  # -1: whole upstream output; N: every N units


class EdgeSpec(NamedTuple):
    from_stage: int
    to_stage: int
    window_size: int | None  # None: runtime.defaults.window_size
    index: int  # position in the YAML list, for messages


def _check(check: Any, value: Any, *, source: str, field: str) -> Any:
    try:
        return check(value)
    except BadValue as exc:
        raise bad_value(exc, source=source, stage_id=None, field=field, value=value) from None


def _mapping(value: Any, *, source: str, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", source=source, field=field, value=value)
    return value


def read_async_chunk(value: Any, *, source: str) -> dict[str, Any]:
    return {"async_chunk": _check(schema.check_bool, value, source=source, field="async_chunk")}


def read_runtime(value: Any, *, source: str) -> dict[str, Any]:
    value = _mapping(value, source=source, field="runtime")
    allowed = ("enabled", "defaults", "edges", "connectors")  # upstream v0.12 nests connectors here
    if unknown := [k for k in value if k not in allowed]:
        raise unknown_keys(unknown, allowed, source=source, section="runtime")
    out: dict[str, Any] = {}
    if "enabled" in value:
        out["runtime.enabled"] = _check(schema.check_bool, value["enabled"], source=source,
                                        field="runtime.enabled")
    if "defaults" in value:
        defaults = _mapping(value["defaults"], source=source, field="runtime.defaults")
        known = ("window_size", "max_inflight")
        if unknown := [k for k in defaults if k not in known]:
            raise unknown_keys(unknown, known, source=source, section="runtime.defaults")
        if "window_size" in defaults:
            out["runtime.defaults.window_size"] = _check(
                check_window, defaults["window_size"], source=source, field="runtime.defaults.window_size")
        if "max_inflight" in defaults:
            out["runtime.defaults.max_inflight"] = _check(
                schema.check_int(1), defaults["max_inflight"], source=source,
                field="runtime.defaults.max_inflight")
    if "edges" in value:
        out["runtime.edges"] = read_edges(value["edges"], source=source, section="runtime.edges")
    if "connectors" in value:
        out.update(read_connectors(value["connectors"], source=source, section="runtime.connectors"))
    return out


def read_edges(value: Any, *, source: str, section: str) -> tuple[EdgeSpec, ...]:
    if value is None:  # upstream's `edges: null`: the stages' engine_input_source decide
        return ()
    if not isinstance(value, list):
        raise ConfigError("must be a list of {from, to, window_size} entries", source=source,
                          field=section, value=value)
    edges: list[EdgeSpec] = []
    for index, entry in enumerate(value):
        where = f"{section}[{index}]"
        entry = _mapping(entry, source=source, field=where)
        allowed = ("from", "to", "window_size")
        if unknown := [k for k in entry if k not in allowed]:
            raise unknown_keys(unknown, allowed, source=source, section=where)
        for key in ("from", "to"):
            if key not in entry:
                raise ConfigError(f"missing required key {key!r}", source=source, field=where)
        src = _check(schema.check_int(0), entry["from"], source=source, field=f"{where}.from")
        dst = _check(schema.check_int(0), entry["to"], source=source, field=f"{where}.to")
        window = None
        if "window_size" in entry:
            window = _check(check_window, entry["window_size"], source=source, field=f"{where}.window_size")
        if any((e.from_stage, e.to_stage) == (src, dst) for e in edges):
            raise ConfigError(f"duplicate edge {src} -> {dst}", source=source, field=where)
        edges.append(EdgeSpec(src, dst, window, index))
    return tuple(edges)


def read_connectors(value: Any, *, source: str, section: str = "connectors") -> dict[str, Any]:
    """`connectors: {<key>: {name: <class>, extra: {...}}}` -> {"connectors.<key>": ConnectorConfig},
    plus {"ignored.<section>.<key>.extra.<option>": reason} for transport options with no effect here."""
    value = _mapping({} if value is None else value, source=source, field=section)  # `connectors: null`: none
    out: dict[str, Any] = {}
    for key, spec in value.items():
        where = f"{section}.{key}"
        spec = _mapping(spec, source=source, field=where)
        if unknown := [k for k in spec if k not in ("name", "extra")]:
            raise unknown_keys(unknown, ("name", "extra"), source=source, section=where)
        name = spec.get("name")
        if name != SHM_CONNECTOR:
            raise ConfigError(f"{name} is not supported: stages exchange data as ZMQ messages whose large tensors "
                              f"travel through shared memory, on one host ({SHM_CONNECTOR})", source=source,
                              field=f"{where}.name", value=name, allowed=SHM_CONNECTOR)
        extra = _mapping(spec.get("extra") or {}, source=source, field=f"{where}.extra")
        for option in sorted(TRANSPORT_OPTIONS.keys() & extra.keys()):
            if problem := transport_option_problem(option, extra):
                raise ConfigError(problem[0], source=source, field=f"{where}.extra.{option}", value=extra[option],
                                  allowed=problem[1])
            out[f"{IGNORED_PREFIX}{where}.extra.{option}"] = TRANSPORT_OPTIONS[option]
        out[f"connectors.{key}"] = ConnectorConfig(key=str(key), name=name,
                                                   extra=tuple((str(k), _freeze(v, source, f"{where}.extra.{k}"))
                                                               for k, v in extra.items()))
    return out


def _freeze(value: Any, source: str, field: str) -> Any:
    # Connector options stay plain data so the frozen config stays hashable and picklable.
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, list):
        return tuple(_freeze(v, source, field) for v in value)
    raise ConfigError("connector options must be scalars or lists", source=source, field=field, value=value)
