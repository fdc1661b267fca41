"""Client events of the realtime API (OpenAI Realtime GA shapes, the subset a voice chat needs),
validated by pydantic at the edge. Unknown fields are errors, as in OpenAI's API.

    event = parse_client_event(text)   # ProtocolError -> an `error` event; the session goes on

Supported: session.update, input_audio_buffer.append / commit / clear, conversation.item.create
/ retrieve / delete / truncate, response.create, response.cancel. Server events are built in
events.py.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ProtocolError(ValueError):
    """A client event the server cannot act on; answered with an `error` event."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.event_id, self.kind = message, code, param, event_id, kind


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------ session


class FormatIn(_Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: int | None = None


class TurnDetectionIn(_Strict):
    type: Literal["server_vad"]
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    prefix_padding_ms: int | None = Field(None, ge=0, le=5000)
    silence_duration_ms: int | None = Field(None, ge=0, le=10000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: None = None  # not supported: only null


class AudioInputIn(_Strict):
    format: FormatIn | None = None
    turn_detection: TurnDetectionIn | None = None  # null turns VAD off (see model_fields_set)
    transcription: None = None  # input transcription is not offered (use /v1/audio/transcriptions)
    noise_reduction: None = None


class OutputFormatIn(_Strict):
    type: Literal["audio/pcm"]
    rate: Literal[24000] | None = None


class AudioOutputIn(_Strict):
    format: OutputFormatIn | None = None
    voice: str | None = None
    speed: Literal[1.0] | None = None


class AudioIn(_Strict):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


Modalities = list[Literal["text", "audio"]]
MaxTokens = Union[Annotated[int, Field(ge=1)], Literal["inf"]]


class SessionIn(_Strict):
    type: Literal["realtime"] | None = None
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: AudioIn | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[None] | None = Field(None, max_length=0)  # function calling is not offered
    tool_choice: Literal["auto", "none"] | None = None


# ------------------------------------------------------------------------------ items


class ContentIn(_Strict):
    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio", "text"]
    text: str | None = None
    audio: str | None = None  # base64 in the session's input format
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ItemIn(_Strict):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentIn] = Field(min_length=1)
    id: str | None = Field(None, min_length=1, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ResponseAudioIn(_Strict):
    output: AudioOutputIn | None = None


class ResponseIn(_Strict):
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    audio: ResponseAudioIn | None = None
    conversation: Literal["auto"] | None = None  # out-of-band responses are not offered
    metadata: dict[str, str] | None = None
    tools: list[None] | None = Field(None, max_length=0)
    tool_choice: Literal["auto", "none"] | None = None


# ------------------------------------------------------------------------------ events


class _Event(_Strict):
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionIn


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: ItemIn
    previous_item_id: str | None = None


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseIn | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Union[SessionUpdate, BufferAppend, BufferCommit, BufferClear, ItemCreate, ItemRetrieve, ItemDelete,
                    ItemTruncate, ResponseCreate, ResponseCancel]
EVENT_TYPES: dict[str, type[BaseModel]] = {cls.model_fields["type"].annotation.__args__[0]: cls  # type: ignore[union-attr]
                                           for cls in ClientEvent.__args__}  # type: ignore[attr-defined]


def parse_client_event(text: str | bytes, event_types: dict[str, type[BaseModel]] | None = None) -> Any:
    """A client event of `event_types` (default: the realtime API's), validated."""
    types = EVENT_TYPES if event_types is None else event_types
    try:
        data: Any = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the event is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ProtocolError("an event must be a JSON object with a 'type'", code="invalid_json")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown event type {kind!r}; supported: {sorted(types)}", code="unknown_event_type",
                            param="type", event_id=event_id)
    try:
        return cls.model_validate(data)  # type: ignore[return-value]
    except ValidationError as e:
        raise _validation_error(e, event_id) from None


def _validation_error(exc: ValidationError, event_id: str | None) -> ProtocolError:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith(("function-", "literal[")))
    if err.get("type") == "extra_forbidden":
        return ProtocolError(f"unknown parameter {where!r}", code="unknown_parameter", param=where, event_id=event_id)
    return ProtocolError(f"{where}: {err.get('msg')}", param=where or None, event_id=event_id)
