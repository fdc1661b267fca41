"""Which sampling values of a chat/completions request reach which stage, and when the stage
config wins (docs/compatibility.md has the table).

Upstream vLLM-Omni builds the comprehension (text) stage's SamplingParams from its YAML and
overrides only the fields of `_OPENAI_SAMPLING_FIELDS` with the request's values; every other
standard field a request sends (top_k, repetition_penalty, ...) leaves the YAML's value in
place (upstream's tests/entrypoints/openai_api/test_serving_chat_sampling_params.py:
test_yaml_custom_params_not_overridden_by_request). A pipeline served from a stage config does
the same here. A plain LM (one stage built without a YAML) has no stage defaults to protect,
so every field applies, as in vLLM. `sampling_params_list` entries set any field of any stage.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# upstream's _OPENAI_SAMPLING_FIELDS (max_completion_tokens arrives as max_tokens)
REQUEST_WINS = frozenset({"temperature", "top_p", "max_tokens", "seed", "stop", "frequency_penalty",
                          "presence_penalty"})
# Not a sampling choice but an output the client asks for (the text stage's logprobs).
OUTPUT_OPTIONS = frozenset({"logprobs"})


def comprehension_overrides(given: dict[str, Any], *, stage_config_wins: bool) -> dict[str, Any]:
    """The request's standard sampling values that apply to the comprehension stage."""
    if not stage_config_wins:
        return dict(given)
    applied = {k: v for k, v in given.items() if k in REQUEST_WINS or k in OUTPUT_OPTIONS}
    if kept := sorted(set(given) - set(applied)):
        logger.debug("request values of %s leave the stage config's in place (set them per stage in "
                     "sampling_params_list)", kept)
    return applied
