"""A request's per-stage SamplingParams, checked before it is admitted.

    params = resolve_sampling_params(pipeline, body, stage_config_wins=...)   # APIError(400, param=...)

Each stage gets its config's `default_sampling_params`, overridden by the request's
`sampling_params_list` entry for that stage, and for the comprehension stage by the standard
fields (`temperature`, `max_tokens`, ...) that sampling_precedence.py lets through. SamplingParams validates every value; its error is
reported against the field the client actually sent (`max_tokens`, or
`sampling_params_list[1].max_tokens`).

`max_tokens` is bounded by the context, as in vLLM: a stage stops at its `max_model_len`. A
stage's default max_tokens is a default, not a cap (upstream's clients ask the thinker for
16384). What guards a stage against a client that would hold it (the talker generating until
max_model_len, keeping the audio path busy for everyone) is an explicit cap, off unless
configured: the stage's `max_tokens_limit` (stage config, `--stage-overrides`, or
`--max-tokens-limit` for every stage). Asking more than the cap, in `sampling_params_list` or in
the standard `max_tokens` / `max_completion_tokens`, is a 400 naming the cap. A request's own
standard max_tokens must also fit the context after its prompt, vLLM's rule: the stage checks that
once it knows the prompt's length (SamplingParams._max_tokens_must_fit), and the answer is vLLM's
400; a default or a sampling_params_list value just stops at max_model_len.
"""
from __future__ import annotations

from typing import Any

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import SamplingFields
from vllm_omni.entrypoints.openai.sampling_precedence import comprehension_overrides
from vllm_omni.sampling_params import InvalidParameter, SamplingParams


def resolve_sampling_params(pipeline: PipelineConfig, body: SamplingFields, *,
                            stage_config_wins: bool) -> list[SamplingParams]:
    stages = pipeline.stages
    given = body.sampling_params_list
    if given is not None and len(given) != len(stages):
        raise APIError(400, f"sampling_params_list has {len(given)} entries; the pipeline has {len(stages)} stages "
                            "(one entry per stage, null for a stage's defaults)", param="sampling_params_list")
    overrides = comprehension_overrides(body.stage_overrides(), stage_config_wins=stage_config_wins)
    comprehension = pipeline.comprehension_stage
    if overrides and comprehension is None:
        raise APIError(400, "this pipeline has no comprehension stage to apply sampling parameters to; use "
                            "sampling_params_list", param=next(iter(overrides)))
    out = []
    for i, stage in enumerate(stages):
        from_list = (given[i] if given is not None else None) or {}
        from_fields = overrides if comprehension is not None and stage.stage_id == comprehension.stage_id else {}

        def param(name: str, i: int = i, from_fields: dict[str, Any] = from_fields) -> str:
            return name if name in from_fields else f"sampling_params_list[{i}].{name}"

        params = _stage_params(stage, {**from_list, **from_fields}, param)
        out.append(params.clone(_max_tokens_must_fit=True) if from_fields.get("max_tokens") is not None else params)
    return out


def _stage_params(stage: StageConfig, values: dict[str, Any], param: Any) -> SamplingParams:
    where = _stage_name(stage)
    if not values:
        return stage.new_sampling_params()
    cap = stage.max_tokens_limit
    if "max_tokens" in values and cap is not None:
        asked = values["max_tokens"]
        if asked is None or (isinstance(asked, int) and asked > cap):
            raise APIError(400, f"max_tokens={asked!r} is over the limit of {where}: at most {cap} tokens "
                                "(the server's max_tokens_limit for this stage)", param=param("max_tokens"))
    defaults = {k: v for k, v in vars(stage.default_sampling_params).items() if not k.startswith("_")}
    try:
        return SamplingParams.from_dict({**defaults, **values}, where=f"{where} sampling params")
    except InvalidParameter as e:
        raise APIError(400, f"{where}: {e}", param=param(e.name)) from None
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{where}: {e}", param=param("sampling_params_list")) from None


def _stage_name(stage: StageConfig) -> str:
    return f"stage {stage.stage_id}" + (f" ({stage.model_stage})" if stage.model_stage else "")
