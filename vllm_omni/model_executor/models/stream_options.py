"""Stream options: how a streaming decoder stage (code2wav, token2wav) cuts its input into
chunks, set by the connector on the stage's input edge (upstream vLLM-Omni's connector
`extra`, e.g. `codec_chunk_frames: 25`).

A GenerationModel class that takes them declares `stream_options_type`, a frozen dataclass
that subclasses `StreamOptions`; its `load()` then accepts `stream_config=` an instance of
it. The stage worker builds that instance with `GenerationModel.stream_config` from the options
the config resolved for the stage (`StageConfig.stream_options`); a model that declares no type
gets none, and options given to it are an error. docs/streaming.md lists each model's keys.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="StreamOptions")


class StreamOptions:
    """Base of a decoder's chunking config: `OPTION_KEYS` maps each connector option it reads
    (as written in a connector's `extra`) to one of its fields."""

    OPTION_KEYS: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_options(cls: type[T], options: Mapping[str, Any]) -> T:
        """The config for these connector options (the others keep their defaults); ValueError
        naming the key for a key this decoder does not read or a value it cannot use."""
        if unknown := sorted(set(options) - set(cls.OPTION_KEYS)):
            raise ValueError(f"{cls.__name__} does not read {', '.join(unknown)}; its options are "
                             f"{', '.join(cls.OPTION_KEYS)}")
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        try:
            return cls(**{cls.OPTION_KEYS[key]: value for key, value in options.items()})
        except ValueError as exc:
            given = ", ".join(f"{key}={value}" for key, value in options.items())
            raise ValueError(f"{given}: {exc}") from None
