"""Which stages run for one request, from the output modalities it asks for.

A request that asks only for text from Qwen2.5-Omni (thinker -> talker -> code2wav) runs the
thinker alone: a stage runs when a requested final output depends on it, and only the
requested final outputs are returned.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_omni.config.stage_config import PipelineConfig


@dataclass(frozen=True)
class RequestPlan:
    stages: frozenset[int]  # stages that run for the request
    outputs: frozenset[int]  # final-output stages whose outputs reach the caller


def available_modalities(pipeline: PipelineConfig) -> list[str]:
    """The final output types of a pipeline, in stage order (e.g. ["text", "audio"])."""
    return list(dict.fromkeys(s.final_output_type.value for s in pipeline.final_stages))


def check_modalities(pipeline: PipelineConfig, modalities: str | Sequence[str] | None) -> list[str] | None:
    """Validated modalities (None: all). ValueError names the available ones."""
    if modalities is None:
        return None
    if isinstance(modalities, str):
        modalities = [modalities]
    available = available_modalities(pipeline)
    if not isinstance(modalities, Sequence) or not modalities:
        raise ValueError(f"modalities must be a non-empty list of output types; available: {available}")
    wanted = []
    for m in modalities:
        if not isinstance(m, str) or m not in available:
            raise ValueError(f"output modality {m!r} is not available; this pipeline produces {available}")
        if m not in wanted:
            wanted.append(m)
    return wanted


def plan_request(pipeline: PipelineConfig, modalities: str | Sequence[str] | None) -> RequestPlan:
    wanted = check_modalities(pipeline, modalities)
    outputs = {s.stage_id for s in pipeline.final_stages if wanted is None or s.final_output_type.value in wanted}
    stages, todo = set(), list(outputs)
    while todo:  # the outputs and everything upstream of them
        sid = todo.pop()
        if sid not in stages:
            stages.add(sid)
            todo.extend(pipeline.stage(sid).engine_input_source)
    return RequestPlan(frozenset(stages), frozenset(outputs))
