"""Request bodies of the OpenAI-compatible API, validated by pydantic (FastAPI) at the edge.

Unknown fields are errors (400 "unsupported parameter 'tools'"), not silently dropped: a
client that asks for tools or n > 1 must learn that it did not get them.
Responses are built as plain dicts in serving_chat / serving_completions.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from vllm_omni.sampling_params import INT64_MAX, INT64_MIN

AudioFormat = Literal["wav", "mp3", "flac", "pcm16", "opus"]
# Formats of input audio the decoders read (libsndfile, FFmpeg); OpenAI documents wav and mp3.
InputAudioFormat = Literal["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a"]


class _Strict(BaseModel):
    # NaN and infinities are not numbers any sampling or media option can use.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --------------------------------------------------------------------------- content parts


class MediaURL(_Strict):
    url: str
    detail: str | None = None  # OpenAI's image detail hint; the processor sizes images itself


def _url_object(value: Any) -> Any:
    # A bare URL string is the object's `url`: one model per field, so a bad key is reported
    # at its own path ("...image_url.foo"), not under a union member's class name.
    return {"url": value} if isinstance(value, str) else value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class _MediaPart(_Strict):
    """A media part holds its source and the processor options documented for its kind
    (docs/compatibility.md); any other key (a second source such as `"image": URL`) is a 400,
    never read."""


class ImageURLPart(_MediaPart):
    type: Literal["image_url"]
    image_url: Annotated[MediaURL, BeforeValidator(_url_object)]
    min_pixels: int | None = Field(None, ge=1)  # the bounds the image is resized within
    max_pixels: int | None = Field(None, ge=1)


class AudioURLPart(_MediaPart):
    type: Literal["audio_url"]
    audio_url: Annotated[MediaURL, BeforeValidator(_url_object)]


class VideoURL(_Strict):
    url: str
    num_frames: int | None = Field(None, ge=1)  # frames to sample (vLLM's video option); also a sibling key


class VideoURLPart(_MediaPart):
    type: Literal["video_url"]
    video_url: Annotated[VideoURL, BeforeValidator(_url_object)]
    # How the video is sampled (multimodal/vision.py VideoSampling; also in mm_processor_kwargs).
    fps: float | None = Field(None, gt=0)
    num_frames: int | None = Field(None, ge=1)
    min_frames: int | None = Field(None, ge=1)
    max_frames: int | None = Field(None, ge=1)
    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)
    total_pixels: int | None = Field(None, ge=1)


class _InputAudio(_Strict):
    data: str  # base64, no "data:" prefix (OpenAI)
    format: InputAudioFormat = "wav"


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: _InputAudio


ContentPart = Annotated[
    Union[TextPart, ImageURLPart, AudioURLPart, VideoURLPart, InputAudioPart], Field(discriminator="type")
]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # OpenAI's participant name; not rendered by the chat templates

    def to_engine(self) -> dict[str, Any]:
        """The message as the engine's chat processing takes it (plain dicts)."""
        content = self.content
        if isinstance(content, list):
            content = [p.model_dump(exclude_none=True) for p in content]
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


# --------------------------------------------------------------------------- sampling


class SamplingFields(_Strict):
    """The standard parameters, applied to the comprehension (first text) stage."""

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # One entry per stage (a dict of SamplingParams fields, or null for the stage's defaults);
    # the standard parameters above are applied on top for the comprehension stage.
    sampling_params_list: list[dict[str, Any] | None] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted for compatibility, not used
    request_id: str | None = Field(None, min_length=1)  # vLLM's: the response id is built from it
    priority: int = 0  # vLLM's; only 0 without priority scheduling (see _no_priority)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (no parallel sampling)")
        return n

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """A nested `"extra_body": {...}` (what the OpenAI SDK's extra_body= sends merged into the
        body, written out by hand in curl examples) is merged into the body; its keys win."""
        if isinstance(data, dict) and "extra_body" in data:
            data = dict(data)
            nested = data.pop("extra_body")
            if not isinstance(nested, dict):
                raise ValueError("extra_body must be an object of request fields")
            data.update(nested)
        return data

    @field_validator("priority")
    @classmethod
    def _no_priority(cls, priority: int) -> int:
        if priority != 0:  # vLLM's answer without --scheduling-policy priority
            raise ValueError(f"priority {priority} is not supported: priority scheduling is not enabled "
                             "(requests are served first come, first served; priority must be 0)")
        return priority

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> SamplingFields:
        # Checked here, not by SamplingParams: a pipeline's stage config may keep its own min_tokens
        # (sampling_precedence.py), and a contradictory request is wrong either way.
        most = self.stage_overrides().get("max_tokens")
        if self.min_tokens is not None and most is not None and self.min_tokens > most:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({most})")
        return self

    def stage_overrides(self) -> dict[str, Any]:
        """The standard parameters that were given, as SamplingParams fields."""
        names = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                 "include_stop_str_in_output", "skip_special_tokens")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema & co., refused with their type
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported: structured output (guided "
                             "decoding) is not implemented; only 'text'")
        return kind


class AudioOutput(_Strict):
    format: AudioFormat = "wav"
    voice: str | None = None  # the speaker; None: the model's default voice


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)
    audio: AudioOutput | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the chat template
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def stage_overrides(self) -> dict[str, Any]:
        fields = super().stage_overrides()
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins, as in vLLM
            fields["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields


class CompletionRequest(SamplingFields):
    model: str | None = None
    # A string, a list of token ids, or a batch of either (one choice per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # top alternatives per token (legacy API)
    response_format: ResponseFormat | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if not prompt or (isinstance(prompt, list) and any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def stage_overrides(self) -> dict[str, Any]:
        fields = super().stage_overrides()
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return fields

    def prompts(self) -> list[dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if all(isinstance(t, int) for t in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]
