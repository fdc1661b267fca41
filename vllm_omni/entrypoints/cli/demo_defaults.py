"""Stage settings of the embedded demo model (no MODEL given), under the user's --stage-overrides.

The demo runs on any CPU. The bundled default of 2048 talker codes (and token2wav over them)
would hold the server's audio path for most of a minute, so the demo's talker stops at 256
codes, and 256 is also its max_tokens_limit, the most a client's sampling_params_list may ask of it. `generate` also
makes its talker speak at least 200 codes (a second of sound): the random-weight talker
otherwise stops after a few dozen, a click rather than speech.
"""
from __future__ import annotations

import json
from typing import Any

SERVE_OVERRIDES: dict[str, Any] = {"1": {"default_sampling_params": {"max_tokens": 256}, "max_tokens_limit": 256}}
GENERATE_OVERRIDES: dict[str, Any] = {"1": {"default_sampling_params": {"max_tokens": 256, "min_tokens": 200}}}


def with_demo_overrides(demo: dict[str, Any], given: str | None) -> str | None:
    """The user's --stage-overrides JSON over the demo's (the user's values win)."""
    try:
        user = json.loads(given) if given else {}
    except json.JSONDecodeError:
        return given  # the config loader reports it, naming the flag
    if not isinstance(user, dict):
        return given
    return json.dumps(_merge(demo, user))


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
