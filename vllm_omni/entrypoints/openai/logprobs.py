"""Logprobs of the text output in OpenAI's two shapes (chat and the legacy completions API).

The engine reports, per output token, {token id: logprob} of the sampled token and its top-N
alternatives (log_softmax of the raw logits, vLLM's default). Tokens are shown as their decoded
text, as vLLM does.
"""
from __future__ import annotations

from typing import Any

TokenLogprobs = list[tuple[int, dict[int, float]]]  # (sampled id, {id: logprob}) per token


def _top(alternatives: dict[int, float], n: int) -> list[tuple[int, float]]:
    # The sampled token is in the dict even when it is not among the top n: rank, then cut.
    return sorted(alternatives.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(tokenizer: Any, tokens: TokenLogprobs, top_n: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one stream chunk)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(tid, alts[tid]), "top_logprobs": [entry(i, lp) for i, lp in _top(alts, top_n)]}
               for tid, alts in tokens]
    return {"content": content}


def completion_logprobs(tokenizer: Any, tokens: TokenLogprobs, top_n: int, text_offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of the legacy completions API; `text_offset` is where the first
    token's text starts in the choice's text."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, alts in tokens:
        text = tokenizer.decode([tid])
        out["tokens"].append(text)
        out["token_logprobs"].append(alts[tid])
        out["top_logprobs"].append({tokenizer.decode([i]): lp for i, lp in _top(alts, top_n)})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out
