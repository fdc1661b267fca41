"""How a talker's code predictor samples groups 1..G-1 of each frame: upstream vLLM-Omni's
`subtalker_sampling_params` (qwen-tts' `subtalker_dosample` / `subtalker_temperature` /
`subtalker_top_k` / `subtalker_top_p`), set per stage in its config.

Unset, the predictor follows the talker: greedy when the talker's request is greedy, else the
model's own settings (`PredictorSampling` defaults are Qwen3-TTS'; Qwen3-Omni passes its own).
`do_sample` set decides alone, as upstream does: `false` makes every frame's residual groups the
argmax (what qwen-tts computes with `subtalker_dosample=False`), `true` samples them even for a
greedy talker request. A request's seed drives the draws either way.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from vllm_omni.sampling_params import GREEDY_TEMPERATURE, SamplingParams


@dataclass(frozen=True)
class PredictorSampling:
    do_sample: bool | None = None  # None: greedy exactly when the talker's request is
    temperature: float = 0.9
    top_k: int = 50  # 0 or -1: no top-k
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample={self.do_sample!r} is invalid: must be true or false")
        try:  # the same ranges as any sampling value
            SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_tokens=None)
        except ValueError as exc:
            raise ValueError(str(exc).replace("SamplingParams.", "")) from None

    @classmethod
    def parse(cls, values: Mapping[str, Any], *, defaults: PredictorSampling | None = None) -> PredictorSampling:
        """Upstream's mapping (keys do_sample, temperature, top_k, top_p) over `defaults`;
        ValueError naming the key for an unknown key or a bad value."""
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(values) - set(known)):
            raise ValueError(f"unknown key(s) {unknown}; allowed: {known}")
        base = {f.name: getattr(defaults or cls(), f.name) for f in fields(cls)}
        return cls(**{**base, **values})

    def greedy_for(self, talker: SamplingParams) -> bool:
        """Whether a frame of a request sampled with `talker` takes the argmax of each group."""
        if self.do_sample is None:
            return talker.greedy
        return not self.do_sample or self.temperature < GREEDY_TEMPERATURE

    def sampled_params(self) -> SamplingParams:
        """Our Sampler's settings for the rows that sample."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_tokens=None)
