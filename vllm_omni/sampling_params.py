"""Sampling parameters with vLLM's semantics.

Validation happens once, here: every invalid value raises ValueError naming the
field and the allowed range, so nothing below this edge re-checks.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

# Below this temperature sampling is greedy (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled (vLLM's field)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Filled by the engine from the tokenizer / generation config; not user-facing.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        if self.n != 1:
            raise bad("n", "1 (parallel sampling is not supported)")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", ">= 1 or None")
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", ">= 0 or None")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "a non-empty list of non-negative token ids or None")
        if any(not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if self.stop and not self.detokenize:
            # Stop strings are matched on the detokenized text (vLLM has the same rule).
            raise ValueError("SamplingParams.stop: stop strings are only supported when detokenize is True")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "sampling params") -> "SamplingParams":
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    def clone(self, **changes: Any) -> "SamplingParams":
        new = copy.copy(self)
        new.stop = list(self.stop)
        new.stop_token_ids = list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            new.allowed_token_ids = list(self.allowed_token_ids)
        for name, value in changes.items():
            if not hasattr(self, name):
                raise ValueError(f"SamplingParams has no field {name!r}")
            setattr(new, name, value)
        if changes:
            new.__post_init__()
        return new
