"""Sampling parameters with vLLM's semantics.

Validation happens once, here: every invalid value raises ValueError naming the
field and the allowed range, so nothing below this edge re-checks.
"""
from __future__ import annotations

import copy
import math
import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

# Below this temperature sampling is greedy (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
# Integers travel between processes as msgpack int64 and seed torch generators (int64):
# anything wider could pass here and fail later, far from the request that sent it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# Stands in a request's token ids for a sampled token still on the device (async scheduling,
# core/llm_engine.py): the next step reads it there; the engine writes the real id in before
# anything else reads it. The sampler counts it from the device for penalties.
PLACEHOLDER_TOKEN = -1


class InvalidParameter(ValueError):
    """A bad request value; `name` is the field it came from (an API error's `param`)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def has_lone_surrogate(text: str) -> bool:
    """True for text that is not valid Unicode (no tokenizer or encoder takes it)."""
    return _LONE_SURROGATE.search(text) is not None


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
    # Set by the API server when max_tokens is a request's own `max_tokens` /
    # `max_completion_tokens`: a prompt that leaves less room fails the request, as vLLM's
    # server does. A default or a sampling_params_list value only runs up to max_model_len.
    _max_tokens_must_fit: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)):
            raise InvalidParameter("stop", f"SamplingParams.stop={_short(self.stop)} is invalid: must be a string or a "
                                           "list of strings")
        self.stop = list(self.stop or [])
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> InvalidParameter:
            return InvalidParameter(name, f"SamplingParams.{name}={_short(getattr(self, name))} is invalid: must be "
                                          f"{allowed}")

        self._validate_types(bad)
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
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "a non-empty list of non-negative token ids or None")
        if any(not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if self.stop and not self.detokenize:
            # Stop strings are matched on the detokenized text (vLLM has the same rule).
            raise ValueError("SamplingParams.stop: stop strings are only supported when detokenize is True")

    def _validate_types(self, bad: Any) -> None:
        """Types and representable ranges, before the semantic checks compare values."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise bad(name, "a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int64(getattr(self, name)):
                raise bad(name, f"an integer in [{INT64_MIN}, {INT64_MAX}]")
        for name in ("seed", "max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int64(value):
                raise bad(name, f"an integer in [{INT64_MIN}, {INT64_MAX}] or None")
        if not all(isinstance(s, str) and not has_lone_surrogate(s) for s in self.stop):
            raise bad("stop", "a list of valid Unicode strings")
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "sampling params") -> "SamplingParams":
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidParameter(str(unknown[0]), f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
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


def _token_ids(name: str, values: Any) -> list[int]:
    """A list of token ids (integral numbers, numpy's included) as plain ints."""
    # Builtins over the whole list, not a Python loop: a talker's allowed ids are ~1000 per
    # request, checked at each admission.
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError(name)
        ids = list(values)
        types = set(map(type, ids))
        if any(issubclass(t, bool) for t in types):
            raise TypeError(name)
        if not types <= {int}:
            ids = list(map(operator.index, ids))
    except TypeError:
        raise InvalidParameter(name, f"SamplingParams.{name}={_short(values)} is invalid: must be a list of token "
                                     "ids") from None
    if ids and not (min(ids) >= 0 and max(ids) <= INT64_MAX):
        raise InvalidParameter(name, f"SamplingParams.{name}={_short(values)} is invalid: token ids must be in "
                                     f"[0, {INT64_MAX}]")
    return ids


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """A value for an error message: a huge one (a 10 MB stop string) is cut."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class DiffusionSamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="diffusion"):
    """Per-request parameters of a diffusion stage (diffusers' pipeline call arguments).

        DiffusionSamplingParams(height=1024, width=1024, num_inference_steps=50, true_cfg_scale=4.0, seed=0)

    A msgspec Struct rather than a dataclass: a StageRequest carries either kind in one field,
    and msgspec tells them apart only when this one encodes as an array (`array_like`).
    Classifier-free guidance runs when `true_cfg_scale > 1` and the prompt has a
    `negative_prompt` (diffusers' QwenImagePipeline rule); `guidance_scale` is the embedded
    guidance of guidance-distilled models and is ignored by the others. Video models (Wan2.2)
    follow diffusers' WanPipeline instead: `guidance_scale` (default 5) is their CFG scale
    (guidance runs when it is > 1), `guidance_scale_2` the low-noise expert's, and
    `true_cfg_scale` is not used.
    """

    height: int | None = None  # None: the model's default (or, for an edit, the input image's)
    width: int | None = None
    num_inference_steps: int = 50
    true_cfg_scale: float = 4.0
    guidance_scale: float | None = None
    seed: int | None = None  # None: a fresh random seed per request
    num_outputs_per_prompt: int = 1
    # Video models (Wan2.2): frames to generate (None: the model's default), and the low-noise
    # expert's guidance scale (None: guidance_scale's).
    num_frames: int | None = None
    guidance_scale_2: float | None = None

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"DiffusionSamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < IMAGE_SIZE_MULTIPLE
                                      or value % IMAGE_SIZE_MULTIPLE):
                raise bad(name, f"a positive multiple of {IMAGE_SIZE_MULTIPLE} or None")
        if not _is_int(self.num_inference_steps) or not 1 <= self.num_inference_steps <= MAX_INFERENCE_STEPS:
            raise bad("num_inference_steps", f"an integer in [1, {MAX_INFERENCE_STEPS}]")
        if not _is_number(self.true_cfg_scale) or self.true_cfg_scale < 0:
            raise bad("true_cfg_scale", "a number >= 0")
        for name in ("guidance_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value < 0):
                raise bad(name, "a number >= 0 or None")
        if self.num_frames is not None and (not _is_int(self.num_frames) or not 1 <= self.num_frames <= MAX_NUM_FRAMES):
            raise bad("num_frames", f"an integer in [1, {MAX_NUM_FRAMES}] or None")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "a non-negative integer or None")
        if not _is_int(self.num_outputs_per_prompt) or not 1 <= self.num_outputs_per_prompt <= MAX_OUTPUTS_PER_PROMPT:
            raise bad("num_outputs_per_prompt", f"an integer in [1, {MAX_OUTPUTS_PER_PROMPT}]")

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "diffusion sampling params") -> DiffusionSamplingParams:
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(cls.__struct_fields__)}")
        return cls(**values)

    def clone(self, **changes: Any) -> DiffusionSamplingParams:
        """A copy with `changes` applied and validated (SamplingParams.clone's contract)."""
        unknown = sorted(set(changes) - set(self.__struct_fields__))
        if unknown:
            raise ValueError(f"DiffusionSamplingParams has no field(s) {unknown}")
        return msgspec.structs.replace(self, **changes)  # runs __post_init__

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


# Latent patches are 16 pixels wide for Qwen-Image, FLUX, SD3 and Wan (VAE x8, then 2x2 packing).
IMAGE_SIZE_MULTIPLE = 16
MAX_INFERENCE_STEPS = 1000  # the training schedule's length
MAX_OUTPUTS_PER_PROMPT = 16
MAX_NUM_FRAMES = 1025  # a sanity bound: 64 s at 16 fps (a GPU runs out of memory long before)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
