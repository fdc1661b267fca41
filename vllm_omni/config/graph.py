"""Stage-graph checks and edge resolution, run before any process starts.

Caught here: stage ids that are not 0..N-1, unknown or self-referencing
`engine_input_source`, cycles, no final output, `runtime.edges` that do not
match the inputs, and connector references that point nowhere.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_omni.config.errors import ConfigError
from vllm_omni.config.stage_config import ConnectorConfig, EdgeConfig, StageConfig
from vllm_omni.config.toplevel import EdgeSpec

# (stage id, canonical path) -> the layer that set it, for messages
SourceOf = Callable[[int, str], str]


def check_stage_ids(stage_ids: Sequence[int], *, source: str) -> None:
    # Spec 000 numbers stages 0, 1, ... and the orchestrator indexes its stage list by id.
    if sorted(stage_ids) != list(range(len(stage_ids))):
        raise ConfigError(f"stage ids {sorted(stage_ids)} are not numbered 0..{len(stage_ids) - 1}",
                          source=source, field="stage_id",
                          allowed="stage ids 0, 1, ..., N-1 without gaps")


def check_graph(stages: Sequence[StageConfig], *, source_of: SourceOf, source: str) -> None:
    ids = {s.stage_id for s in stages}
    allowed = "ids of other stages: " + ", ".join(str(i) for i in sorted(ids))
    for stage in stages:
        where = source_of(stage.stage_id, "engine_input_source")
        for src in stage.engine_input_source:
            if src == stage.stage_id:
                raise ConfigError(f"stage {src} cannot take input from itself", source=where,
                                  stage_id=stage.stage_id, field="engine_input_source",
                                  value=list(stage.engine_input_source), allowed=allowed)
            if src not in ids:
                raise ConfigError(f"stage {src} does not exist", source=where, stage_id=stage.stage_id,
                                  field="engine_input_source", value=list(stage.engine_input_source),
                                  allowed=allowed)
        if len(set(stage.engine_input_source)) != len(stage.engine_input_source):
            raise ConfigError("a source stage is listed twice", source=where, stage_id=stage.stage_id,
                              field="engine_input_source", value=list(stage.engine_input_source))
    # Requests enter the pipeline at stage 0 (spec 003's orchestrator); any other stage
    # without inputs would never receive work.
    for stage in stages:
        if (stage.stage_id == 0) != (not stage.engine_input_source):
            problem = ("stage 0 receives the requests, so it takes no input from other stages"
                       if stage.stage_id == 0 else
                       f"stage {stage.stage_id} has no engine_input_source, so no request would reach it")
            raise ConfigError(problem, source=source_of(stage.stage_id, "engine_input_source"),
                              stage_id=stage.stage_id, field="engine_input_source",
                              value=list(stage.engine_input_source),
                              allowed="[] for stage 0, a list of upstream stage ids for every other stage")
    cycle = _find_cycle({s.stage_id: s.engine_input_source for s in stages})
    if cycle:
        path = " -> ".join(str(i) for i in cycle)
        raise ConfigError(f"engine_input_source forms a cycle: stage {path} (each feeds the next)",
                          source=source_of(cycle[0], "engine_input_source"),
                          allowed="an acyclic stage graph")
    if not any(s.final_output for s in stages):
        raise ConfigError("no stage has final_output: true, so a request would return nothing",
                          source=source, field="final_output",
                          allowed="at least one stage with final_output: true")


def _find_cycle(inputs: dict[int, Sequence[int]]) -> list[int] | None:
    """Return a cycle as [a, b, ..., a] in data-flow order, or None."""
    state: dict[int, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[int] = []

    def visit(node: int) -> list[int] | None:
        state[node] = 1
        stack.append(node)
        for src in inputs.get(node, ()):
            if state.get(src) == 1:
                loop = stack[stack.index(src):] + [src]
                return loop[::-1]  # the DFS walks against the data flow
            if src not in state and (found := visit(src)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(inputs):
        if node not in state and (found := visit(node)):
            return found
    return None


def resolve_edges(stages: Sequence[StageConfig], specs: Sequence[EdgeSpec] | None, *,
                  default_window: int, connectors: Sequence[ConnectorConfig], edges_source: str,
                  source_of: SourceOf) -> tuple[EdgeConfig, ...]:
    """Explicit `runtime.edges` where given, else derived from engine_input_source."""
    by_id = {s.stage_id: s for s in stages}
    explicit = {(e.from_stage, e.to_stage): e for e in specs or ()}
    for (src, dst), spec in explicit.items():
        where = f"runtime.edges[{spec.index}]"
        if dst not in by_id or src not in by_id:
            raise ConfigError(f"edge {src} -> {dst} names a stage that does not exist", source=edges_source,
                              field=where, allowed="stage ids " + ", ".join(map(str, sorted(by_id))))
        if src not in by_id[dst].engine_input_source:
            raise ConfigError(f"edge {src} -> {dst} has no matching engine_input_source "
                              f"(stage {dst} takes input from {list(by_id[dst].engine_input_source)})",
                              source=edges_source, field=where,
                              allowed="edges that follow the stages' engine_input_source")
    known = {c.key for c in connectors}
    edges = []
    for stage in stages:
        for src in stage.engine_input_source:
            spec = explicit.get((src, stage.stage_id))
            window = spec.window_size if spec and spec.window_size is not None else default_window
            connector = _edge_connector(by_id[src], stage, known, source_of)
            edges.append(EdgeConfig(src, stage.stage_id, window, connector))
    _check_dangling_refs(stages, source_of)
    return tuple(sorted(edges, key=lambda e: (e.from_stage, e.to_stage)))


def _edge_connector(src: StageConfig, dst: StageConfig, known: set[str], source_of: SourceOf) -> str | None:
    into = dict(dst.input_connectors).get(src.stage_id)
    out = dict(src.output_connectors).get(dst.stage_id)
    if into and out and into != out:
        raise ConfigError(f"edge {src.stage_id} -> {dst.stage_id} names two connectors: "
                          f"{into!r} (stage {dst.stage_id} input_connectors) and {out!r} "
                          f"(stage {src.stage_id} output_connectors)",
                          source=source_of(dst.stage_id, f"input_connectors.{src.stage_id}"))
    refs = ((into, dst, f"input_connectors.{src.stage_id}", f"input_connectors.from_stage_{src.stage_id}"),
            (out, src, f"output_connectors.{dst.stage_id}", f"output_connectors.to_stage_{dst.stage_id}"))
    for name, stage, path, shown in refs:
        if name and name not in known:
            raise ConfigError("names an unknown connector", source=source_of(stage.stage_id, path),
                              stage_id=stage.stage_id, field=shown, value=name,
                              allowed="keys of the top-level connectors: "
                              + (", ".join(sorted(known)) or "(none defined)"))
    return into or out


def _check_dangling_refs(stages: Sequence[StageConfig], source_of: SourceOf) -> None:
    downstream = {s.stage_id: {d.stage_id for d in stages if s.stage_id in d.engine_input_source}
                  for s in stages}
    for stage in stages:
        for src, _ in stage.input_connectors:
            if src not in stage.engine_input_source:
                raise ConfigError(f"stage {stage.stage_id} takes no input from stage {src}",
                                  source=source_of(stage.stage_id, f"input_connectors.{src}"),
                                  stage_id=stage.stage_id, field=f"input_connectors.from_stage_{src}",
                                  allowed=f"from_stage_<id> for ids in engine_input_source "
                                          f"{list(stage.engine_input_source)}")
        for dst, _ in stage.output_connectors:
            if dst not in downstream[stage.stage_id]:
                raise ConfigError(f"stage {dst} takes no input from stage {stage.stage_id}",
                                  source=source_of(stage.stage_id, f"output_connectors.{dst}"),
                                  stage_id=stage.stage_id, field=f"output_connectors.to_stage_{dst}",
                                  allowed=f"to_stage_<id> for ids {sorted(downstream[stage.stage_id])}")
