"""Refuse a prompt that cannot fit before spending time on it.

    limit = PromptLimit.of(engine)           # once the stages are up (api_server.build_context)
    limit.check(chat_text_chars(messages), "messages", len(messages))   # APIError(413) if surely too long

Tokenizing 20 MB of text takes tens of seconds and gigabytes only to learn that the prompt
is far over `max_model_len`. No token of the tokenizer's vocabulary covers more than
`max_token_chars` characters of text (the longest vocabulary entry, special tokens
included), so a text of C characters has at least C / max_token_chars tokens: above
`max_model_len * max_token_chars` characters the prompt cannot fit, whatever its content.
A chat template renders each message with at least one token of its own (the role markers),
so every message adds one more. The bound is loose on purpose (the exact check still runs in
the stage); it only removes the cost of absurd inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_omni.entrypoints.openai.errors import APIError


@dataclass(frozen=True)
class PromptLimit:
    max_model_len: int
    max_token_chars: int

    @classmethod
    def of(cls, engine: Any) -> PromptLimit | None:
        """From the entry stage's max_model_len and the tokenizer; None when either is unknown."""
        entry = engine.pipeline.entry_stages[0].stage_id
        info = next((h.info for h in engine.stage_health() if h.stage_id == entry), None)
        tokenizer = engine.get_tokenizer()
        if info is None or info.max_model_len is None or tokenizer is None:
            return None
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
        return cls(info.max_model_len, max(1, longest))

    def check(self, chars: int, param: str, num_messages: int = 0) -> None:
        min_tokens = math.ceil(chars / self.max_token_chars) + num_messages
        if min_tokens > self.max_model_len:
            raise APIError(413, f"the prompt has {chars} characters" + (f" in {num_messages} messages" if num_messages
                                else "") + f", so at least {min_tokens} tokens: more than max_model_len="
                                f"{self.max_model_len}", param=param)


def chat_text_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in chat messages (text parts and string contents; not media)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text", "")) for part in content if part.get("type") == "text")
    return total
