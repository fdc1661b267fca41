"""Request bodies of the OpenAI-compatible API, validated by pydantic (FastAPI) at the edge.

Unknown fields are errors (400 "unsupported parameter 'tools'"), not silently dropped: a
client that asks for tools, logprobs or n > 1 must learn that it did not get them.
Responses are built as plain dicts in serving_chat / serving_completions.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_omni.sampling_params import INT64_MAX, INT64_MIN

AudioFormat = Literal["wav", "mp3", "flac", "pcm16", "opus"]
# Formats of input audio the decoders read (libsndfile, FFmpeg); OpenAI documents wav and mp3.
InputAudioFormat = Literal["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a"]


class _Strict(BaseModel):
    # NaN and infinities are not numbers any sampling or media option can use.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --------------------------------------------------------------------------- content parts


class _URL(_Strict):
    url: str
    detail: str | None = None  # OpenAI's image detail hint; the processor sizes images itself


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class _MediaPart(BaseModel):
    # Extra keys are per-item processor options (min_pixels, fps, max_frames, ...), which the
    # multimodal processor validates; they are passed through unchanged.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ImageURLPart(_MediaPart):
    type: Literal["image_url"]
    image_url: _URL | str


class AudioURLPart(_MediaPart):
    type: Literal["audio_url"]
    audio_url: _URL | str


class VideoURLPart(_MediaPart):
    type: Literal["video_url"]
    video_url: _URL | str


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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (no parallel sampling)")
        return n

    def stage_overrides(self) -> dict[str, Any]:
        """The standard parameters that were given, as SamplingParams fields."""
        names = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                 "include_stop_str_in_output", "skip_special_tokens")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class StreamOptions(_Strict):
    include_usage: bool = False


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

    def stage_overrides(self) -> dict[str, Any]:
        fields = super().stage_overrides()
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins, as in vLLM
            fields["max_tokens"] = self.max_completion_tokens
        return fields


class CompletionRequest(SamplingFields):
    model: str | None = None
    # A string, a list of token ids, or a batch of either (one choice per prompt).
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if not prompt or (isinstance(prompt, list) and any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if all(isinstance(t, int) for t in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]
