"""POST /v1/audio/speech (OpenAI's text-to-speech API), for TTS models.

    {"model": ..., "input": "Hello!", "voice": "vivian", "response_format": "mp3", "speed": 1.0,
     "instructions": "...", "stream_format": "audio" | "sse",
     "task_type": ..., "language": ..., "ref_audio": URL | data URL | base64, "ref_text": ...}

The request becomes a TTS prompt for the pipeline's input processor (its model family's, in
multimodal/), which refuses what the checkpoint cannot do (an unknown voice names the voices) -> 400.
What the served checkpoint is (its task type, voices, frame size) its family answers
(`FAMILY.speech_model`); a model whose family does not speak text gets 400 here. `voice`
names a preset or a stored voice (serving_voices.py: a cloned voice's encodings, a designed
voice's instructions).
Responses (docs/tts.md):
- no stream_format: the whole file, with usage in x-vllm-omni-*-tokens headers;
- "audio": chunked bytes as the pipeline hands audio on (pcm or wav: a streaming WAV header,
  then 16-bit PCM); chunks concatenate into the file;
- "sse": `speech.audio.delta` events (base64 of the same bytes), then `speech.audio.done` with
  usage (input_tokens = text tokens of input + instructions, output_tokens = codec frames), or
  `speech.audio.error`.
"""
from __future__ import annotations

import base64
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE, check_format
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.media_fetch import count_upload, fetch_media
from vllm_omni.entrypoints.openai.response_tracker import AudioEvent, ResponseTracker
from vllm_omni.entrypoints.openai.serving_base import (
    EventStream, ServingContext, as_api_error, engine_error, first_output, race_disconnect, set_final_status,
)
from vllm_omni.entrypoints.openai.serving_voices import VoicesService
from vllm_omni.entrypoints.openai.speech_audio import (
    SPEECH_MEDIA_TYPES, STREAMABLE_FORMATS, change_speed, encode_speech, encoder_format, pcm16, wav_stream_header,
)
from vllm_omni.model_executor.models.family import SpeechModel
from vllm_omni.outputs import OmniRequestOutput

ENDPOINT = "/v1/audio/speech"
MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
DEFAULT_MAX_INSTRUCTIONS = 500  # spec 001: --tts-max-instructions-length default


# Field types shared with the batch route's items (serving_speech_batch.py).
ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
TaskType = Literal["CustomVoice", "VoiceDesign", "Base"]
Speed = Annotated[float, Field(ge=0.25, le=4.0)]
MaxNewTokens = Annotated[int, Field(ge=1)]


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str
    voice: str | None = None
    response_format: ResponseFormat = "mp3"  # OpenAI's default
    speed: Speed = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] | None = None
    # vLLM-Omni's extensions
    task_type: TaskType | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    non_streaming_mode: bool | None = None
    max_new_tokens: MaxNewTokens | None = None
    # upstream vLLM-Omni's spelling of stream_format "audio" (its benchmark client sends it)
    stream: bool | None = None

    @model_validator(mode="after")
    def _upstream_stream(self) -> SpeechRequest:
        if self.stream and self.stream_format is None:
            self.stream_format = "audio"
        return self


class SpeechService:
    def __init__(self, ctx: ServingContext, info: SpeechModel | None, voices: VoicesService,
                 max_instructions_length: int = DEFAULT_MAX_INSTRUCTIONS) -> None:
        self.ctx = ctx
        self.info = info  # None: the served model does not speak text
        self.voices = voices
        self.max_instructions_length = max_instructions_length

    def _tts(self) -> SpeechModel:
        if self.info is None:
            raise APIError(400, f"the served model ({self.ctx.model_path}) is not a text-to-speech model")
        return self.info

    def _check(self, body: SpeechRequest) -> None:
        if not body.input.strip():
            raise APIError(400, "input must be a non-empty text", param="input")
        if len(body.input) > MAX_INPUT_CHARS:
            raise APIError(413, f"input is {len(body.input)} characters; the limit is {MAX_INPUT_CHARS}",
                           param="input")
        self.check_instructions(body.instructions)
        if body.stream_format is not None and body.response_format not in STREAMABLE_FORMATS:
            raise APIError(400, f"streaming (stream_format={body.stream_format!r}) needs response_format pcm or wav",
                           param="response_format")
        if body.stream_format is not None and body.speed != 1.0:
            raise APIError(400, "speed must be 1.0 when streaming", param="speed")
        check_format(encoder_format(body.response_format))

    def check_instructions(self, instructions: str | None) -> None:
        if instructions is not None and len(instructions) > self.max_instructions_length:
            raise APIError(400, f"instructions are {len(instructions)} characters; the limit is "
                                f"{self.max_instructions_length} (--tts-max-instructions-length)",
                           param="instructions")

    async def _prompt(self, body: SpeechRequest) -> dict[str, Any]:
        self._tts()
        prompt: dict[str, Any] = {"prompt": body.input}
        prompt.update(self.voices.speech_options(body.voice, body.ref_audio is not None, body.instructions is not None))
        for key in ("instructions", "language", "task_type", "ref_text", "x_vector_only_mode", "non_streaming_mode"):
            if getattr(body, key) is not None:
                prompt[key] = getattr(body, key)
        if body.ref_audio is not None:
            prompt["ref_audio"] = await self.reference_audio(body.ref_audio)
        return prompt

    async def reference_audio(self, value: str) -> Any:
        """URLs through the media gate; anything else is taken for bare base64."""
        if value.startswith(("data:", "http://", "https://", "file:")):
            return await fetch_media(value, "audio", self.ctx.media)
        try:
            data = base64.b64decode("".join(value.split()), validate=True)
        except ValueError:
            raise APIError(400, "ref_audio must be an http(s) URL, a data URL or base64 audio", param="ref_audio") \
                from None
        count_upload(len(data), self.ctx.media)
        return data

    async def create(self, body: SpeechRequest, raw: Request) -> Any:
        if body.stream_format is None:
            audio, usage = await self.render(body, raw)
            headers = {f"x-vllm-omni-{k.replace('_', '-')}": str(v) for k, v in usage.items()}
            return Response(audio, media_type=SPEECH_MEDIA_TYPES[body.response_format], headers=headers)
        prompt, acc, gen, ticket = await self._submit(body, raw)
        try:
            first = await first_output(self.ctx, raw, gen)
            stream = self._stream(raw, body, prompt, acc, first, gen, ticket)
            response = EventStream(stream, raw, partial(_close, ticket, gen))
            if body.stream_format == "audio":
                _set_media_type(response, SPEECH_MEDIA_TYPES[body.response_format])
            return response
        except BaseException as e:
            ticket.release()
            await gen.aclose()
            raise as_api_error(self.ctx, e)  # noqa: B904 - chained inside as_api_error

    async def render(self, body: SpeechRequest, raw: Request) -> tuple[bytes, dict[str, int]]:
        """The whole file of a request that does not stream, and its usage (APIError: why not)."""
        prompt, acc, gen, ticket = await self._submit(body, raw)
        try:
            first = await first_output(self.ctx, raw, gen)
            await race_disconnect(raw, _collect(first, gen, acc))
        except BaseException as e:
            await gen.aclose()
            raise as_api_error(self.ctx, e)  # noqa: B904 - chained inside as_api_error
        finally:
            ticket.release()
        self.ctx.record_finished(ENDPOINT, acc)
        wave = change_speed(acc.audio(), OUTPUT_SAMPLE_RATE, body.speed)
        return encode_speech(wave, OUTPUT_SAMPLE_RATE, body.response_format), self._usage(prompt, acc)

    async def _submit(self, body: SpeechRequest, raw: Request) -> tuple[dict[str, Any], ResponseTracker, Any, Any]:
        """Check the request and hand it to the engine once admitted: (prompt, tracker, outputs, ticket)."""
        ctx, arrived = self.ctx, time.monotonic()
        ctx.check_model(body.model)
        self._check(body)
        prompt = await self._prompt(body)
        params = [{"max_tokens": body.max_new_tokens} if body.max_new_tokens else None] + \
            [None] * (ctx.shape.num_stages - 1)
        ctx.check_stages_up(ctx.shape.needed_stages(["audio"]))
        ticket = await race_disconnect(raw, ctx.gate.admit())
        gen = ctx.engine.generate(prompt, params, request_id=f"speech-{uuid.uuid4().hex}", modalities=["audio"],
                                  output_partial=True)
        return prompt, ResponseTracker(arrived_at=arrived), gen, ticket

    def _usage(self, prompt: dict[str, Any], acc: ResponseTracker) -> dict[str, int]:
        tokenizer = self.ctx.engine.get_tokenizer()
        texts = [prompt["prompt"], prompt.get("instructions") or ""]  # (a designed voice's too)
        text_tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts if t)
        frames = math.ceil(acc.audio_samples / self._tts().samples_per_frame)
        return {"input_tokens": text_tokens, "output_tokens": frames, "total_tokens": text_tokens + frames}

    async def _stream(self, raw: Request, body: SpeechRequest, prompt: dict[str, Any], acc: ResponseTracker,
                      first: OmniRequestOutput,
                      gen: AsyncIterator[OmniRequestOutput], ticket: Any) -> AsyncIterator[Any]:
        sse, status = body.stream_format == "sse", 200

        def piece(data: bytes) -> Any:
            if not sse:
                return data
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
            return f"event: speech.audio.delta\ndata: {json.dumps(event)}\n\n"

        try:
            if body.response_format == "wav":
                yield piece(wav_stream_header(OUTPUT_SAMPLE_RATE))
            for event in acc.add(first):
                if isinstance(event, AudioEvent) and event.samples.size:
                    yield piece(pcm16(event.samples))
            async for out in gen:
                for event in acc.add(out):
                    if isinstance(event, AudioEvent) and event.samples.size:
                        yield piece(pcm16(event.samples))
            if not acc.audio_finished:
                raise APIError(500, "the pipeline ended the request without audio")
            if sse:
                done = {"type": "speech.audio.done", "usage": self._usage(prompt, acc)}
                yield f"event: speech.audio.done\ndata: {json.dumps(done)}\n\n"
            self.ctx.record_finished(ENDPOINT, acc)
        except BaseException as e:  # noqa: BLE001 - a stream's failure can only be reported in-band
            err = engine_error(self.ctx, e)
            if not isinstance(err, APIError):
                status = 499  # cancelled: the client left (AsyncOmni aborted the request)
                raise
            status = err.status
            if sse:
                error = {"type": "speech.audio.error", "error": err.body()["error"]}
                yield f"event: speech.audio.error\ndata: {json.dumps(error)}\n\n"
        finally:
            ticket.release()
            set_final_status(raw, status)


async def _collect(first: OmniRequestOutput, gen: AsyncIterator[OmniRequestOutput], acc: ResponseTracker) -> None:
    acc.add(first)
    async for out in gen:
        acc.add(out)
    if not acc.audio_finished:
        raise APIError(500, "the pipeline ended the request without audio")


def _set_media_type(response: EventStream, media_type: str) -> None:
    response.media_type = media_type
    response.raw_headers = [(k, v) for k, v in response.raw_headers if k != b"content-type"]
    response.raw_headers.append((b"content-type", media_type.encode()))


async def _close(ticket: Any, gen: Any) -> None:
    ticket.release()
    await gen.aclose()  # aborts the request in every stage unless it already finished
