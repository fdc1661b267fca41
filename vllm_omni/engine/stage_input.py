"""Calling stage input processors (bridges, spec 003) one request at a time.

A bridge keeps the spec 003 signature `fn(stage_list, engine_input_source, prompt,
requires_multimodal_data) -> list[OmniTokensPrompt]`, where
`stage_list[src].engine_outputs` is a list of RequestOutput. The orchestrator calls
it per request with views that hold only that request's outputs, so a bridge written
for a batch sees a batch of one and can never mix requests; it must return exactly
one input.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.config.stage_config import StageConfig
from vllm_omni.imports import import_dotted
from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.outputs import RequestOutput

InputProcessor = Callable[[list[Any], list[int], Any, bool], list[OmniTokensPrompt]]


@dataclass
class StageView:
    """What a bridge sees of one stage: its outputs for the request being forwarded."""

    stage_id: int
    engine_outputs: list[RequestOutput] = field(default_factory=list)


def default_input_processor(
    stage_list: list[Any], engine_input_source: list[int], prompt: Any = None, requires_multimodal_data: bool = False
) -> list[OmniTokensPrompt]:
    """Spec 003 default: the first source's output token ids become the next prompt."""
    mm = prompt.get("multi_modal_data") if requires_multimodal_data and isinstance(prompt, Mapping) else None
    return [
        OmniTokensPrompt(prompt_token_ids=list(out.outputs[0].token_ids), multi_modal_data=mm)
        for out in stage_list[engine_input_source[0]].engine_outputs
    ]


def resolve_input_processor(stage: StageConfig, model: str | None = None) -> tuple[InputProcessor, str]:
    """The stage's bridge and a name for messages; import errors name the stage.

    No custom_process_input_func: the stage model's own default bridge if the registry has
    one (looked up by model_arch, else the architecture in `model`'s config.json), else the
    spec 003 default."""
    path = stage.custom_process_input_func
    if path is None:
        from vllm_omni.model_executor.models.registry import default_stage_input_processor

        path = default_stage_input_processor(_architecture(stage, model), stage.model_stage)
    if path is None:
        return default_input_processor, "the default input processor"
    try:
        fn = import_dotted(path)
    except ImportError as e:
        raise ValueError(f"stage {stage.stage_id}: custom_process_input_func: {e}") from e
    if not callable(fn):
        raise ValueError(f"stage {stage.stage_id}: custom_process_input_func {path!r} is not callable")
    return fn, path


def _architecture(stage: StageConfig, model: str | None) -> str | None:
    if stage.engine_args.model_arch is not None:
        return stage.engine_args.model_arch
    folder = stage.engine_args.model or model
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None  # nothing to look up: the stage keeps the spec 003 default
    from vllm_omni.config.bundled import model_architecture

    return model_architecture(folder)


def build_stage_input(
    fn: InputProcessor,
    fn_name: str,
    stage: StageConfig,
    num_stages: int,
    source_outputs: Mapping[int, RequestOutput],
    prompt: Any,
    request_id: str,
) -> OmniTokensPrompt:
    """Run the bridge for one request and check what it returned. Raises ValueError."""
    for src, out in source_outputs.items():
        if out.request_id != request_id:  # cannot happen by construction; cheap to make sure
            raise ValueError(f"stage {src} output belongs to request {out.request_id}, not {request_id}")
    views = [StageView(i, [source_outputs[i]] if i in source_outputs else []) for i in range(num_stages)]
    try:
        result = fn(views, list(stage.engine_input_source), prompt, stage.requires_multimodal_data)
    except Exception as e:  # noqa: BLE001 - user code: the request fails with the reason
        raise ValueError(f"stage {stage.stage_id}: {fn_name} failed for request {request_id}: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(result, (list, tuple)) or len(result) != 1:
        got = f"{len(result)} inputs" if isinstance(result, (list, tuple)) else type(result).__name__
        raise ValueError(f"stage {stage.stage_id}: {fn_name} must return a list with one input per request; "
                         f"got {got} for request {request_id}")
    return _check_input(result[0], stage.stage_id, fn_name, request_id)


def _check_input(item: Any, stage_id: int, fn_name: str, request_id: str) -> OmniTokensPrompt:
    where = f"stage {stage_id}: {fn_name} (request {request_id})"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} returned a {type(item).__name__}, not an OmniTokensPrompt")
    ids = item.get("prompt_token_ids")
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{where} returned no prompt_token_ids (an upstream stage with no token output "
                         "needs a custom_process_input_func)")
    info = item.get("additional_information") or {}
    if not isinstance(info, Mapping):
        raise ValueError(f"{where}: additional_information must be a dict, got {type(info).__name__}")
    return OmniTokensPrompt(prompt_token_ids=[int(t) for t in ids], additional_information=dict(info),
                            multi_modal_data=item.get("multi_modal_data"))
