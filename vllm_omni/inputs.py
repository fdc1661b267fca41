"""Prompt shapes accepted by `Omni` / `AsyncOmni` and returned by stage input processors.

They are TypedDicts (vLLM's shape), so a user's plain dict prompt and the
`OmniTokensPrompt(prompt_token_ids=..., additional_information=...)` a bridge builds
(spec 003) are the same kind of object.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, Union

from typing_extensions import NotRequired, Required  # typing has them from 3.11 only


class TextPrompt(TypedDict, total=False):
    prompt: Required[str]
    multi_modal_data: NotRequired[dict[str, Any] | None]
    additional_information: NotRequired[dict[str, Any] | None]  # e.g. processed media, a voice


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: Required[list[int]]
    prompt: NotRequired[str]  # the text the ids came from, reported back in outputs
    multi_modal_data: NotRequired[dict[str, Any] | None]


class OmniTokensPrompt(TokensPrompt, total=False):
    """A stage's input built from upstream outputs (spec 003).

    `additional_information` carries per-request payloads to the next stage: tensors
    travel as zero-copy frames or shared memory, other values must be msgpack data
    (numbers, strings, lists, dicts). AR stages understand `prompt_embeds` (a [P, H]
    tensor replacing the prompt's token embeddings); other keys go to the stage model.
    """

    additional_information: NotRequired[dict[str, Any] | None]


PromptType = Union[str, TextPrompt, TokensPrompt, OmniTokensPrompt]


def parse_prompt(prompt: Any) -> OmniTokensPrompt | TextPrompt:
    """Validate one user prompt; a string becomes a TextPrompt. Raises ValueError on bad shapes."""
    if isinstance(prompt, str):
        return TextPrompt(prompt=prompt)
    if not isinstance(prompt, Mapping):
        raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
    info = prompt.get("additional_information")
    if info is not None and not isinstance(info, Mapping):
        raise ValueError(f"additional_information must be a dict, got {type(info).__name__}")
    allowed = {"prompt", "prompt_token_ids", "multi_modal_data", "additional_information"}
    unknown = sorted(set(prompt) - allowed)
    if unknown:
        raise ValueError(f"prompt has unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        out: OmniTokensPrompt = OmniTokensPrompt(prompt_token_ids=[int(t) for t in ids])
        for key in ("prompt", "multi_modal_data", "additional_information"):
            if prompt.get(key) is not None:
                out[key] = prompt[key]  # type: ignore[literal-required]
        return out
    if not isinstance(prompt.get("prompt"), str):
        raise ValueError("a dict prompt needs 'prompt' (a string) or 'prompt_token_ids'")
    out = TextPrompt(prompt=prompt["prompt"])
    for key in ("multi_modal_data", "additional_information"):
        if prompt.get(key) is not None:
            out[key] = prompt[key]  # type: ignore[literal-required]
    return out


__all__ = ["TextPrompt", "TokensPrompt", "OmniTokensPrompt", "PromptType", "parse_prompt"]
