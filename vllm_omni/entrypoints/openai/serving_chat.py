"""POST /v1/chat/completions: text and speech out of a multi-stage pipeline.

Response layout (upstream vLLM-Omni): one choice per requested output modality, in stage
order: text in `choices[i].message.content`, speech in `choices[j].message.audio =
{id, data (base64 of the encoded file), expires_at, transcript}`. With `stream: true` the same
choice indices carry SSE `chat.completion.chunk`s: text deltas as the stage generates them, and
audio chunks (`delta.audio.data`, each chunk a complete file in the requested format; in
`delta.content` with `--audio-stream-shape upstream`) as soon as the audio stage hands them
over; then `data: [DONE]`. Every chunk names its `modality`.

Partial responses (docs/compatibility.md): when a later stage fails after an earlier one finished
an output the client asked for (the talker fails, the text is complete), the response is still
200 with that output; the failed output's choice has `finish_reason: "error"` and an OpenAI-shaped
`error` object (HTTP status in `code`). A stream has already sent the text by then: the error
follows in-band, then [DONE].
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from functools import partial
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.async_omni import RequestFailedError
from vllm_omni.entrypoints.openai.access_log import note_access
from vllm_omni.entrypoints.openai.response_tracker import AudioEvent, ResponseTracker, TextEvent
from vllm_omni.entrypoints.openai.admission import Ticket
from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE, check_format, encode_audio
from vllm_omni.entrypoints.openai.chat_options import ChatOptions
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.logprobs import chat_logprobs
from vllm_omni.entrypoints.openai.media_fetch import resolve_media
from vllm_omni.entrypoints.openai.prompt_limits import chat_text_chars
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest
from vllm_omni.entrypoints.openai.serving_base import (
    EventStream, ServingContext, as_api_error, engine_error, first_output, race_disconnect, response_metrics,
    set_final_status,
)
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/chat/completions"
AUDIO_TTL_S = 24 * 3600  # `expires_at` of audio objects (upstream's value); nothing is stored
CHEAP_FORMATS = ("wav", "pcm16")  # a streamed chunk in these is encoded on the loop


class ChatView:
    """Builds the JSON of one request's response or stream chunks."""

    def __init__(self, request_id: str, model: str, modalities: list[str], audio_format: str,
                 options: ChatOptions, top_logprobs: int | None = None, tokenizer: Any = None) -> None:
        self.request_id = request_id
        self.model = model
        self.modalities = modalities  # what the client asked for, in stage (= choice) order
        self.audio_format = audio_format
        self.audio_in_content = options.audio_stream_shape == "upstream"
        self.top_logprobs = top_logprobs  # None: the request did not ask for logprobs
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.audio_id = f"audio-{uuid.uuid4().hex[:16]}"

    def logprobs(self, tokens: list) -> dict[str, Any] | None:
        return None if self.top_logprobs is None else chat_logprobs(self.tokenizer, tokens, self.top_logprobs)

    def index(self, modality: str) -> int | None:
        return self.modalities.index(modality) if modality in self.modalities else None

    async def audio_object(self, samples: Any, transcript: str, chunk: bool = False) -> dict[str, Any]:
        """`chunk`: one streamed chunk (a few seconds at most), which as wav or pcm16 is a header
        and a copy: encoded at once, on the loop (a thread hop, ~0.1-1 ms and more when the loop's
        pool is busy, came before every audio chunk). A whole reply, and mp3 / opus / aac / flac
        (an encoder's work), go off the loop."""
        if chunk and self.audio_format in CHEAP_FORMATS:
            raw = encode_audio(samples, OUTPUT_SAMPLE_RATE, self.audio_format)
        else:
            raw = await asyncio.to_thread(encode_audio, samples, OUTPUT_SAMPLE_RATE, self.audio_format)
        data = base64.b64encode(raw).decode("ascii")
        return {"id": self.audio_id, "data": data, "expires_at": self.created + AUDIO_TTL_S, "transcript": transcript}

    async def response(self, acc: ResponseTracker, failure: APIError | None = None) -> dict[str, Any]:
        """`failure`: the error of an output that did not finish (a partial response)."""
        choices = []
        for i, modality in enumerate(self.modalities):
            if failure is not None and not acc.finished(modality):
                choices.append({"index": i, "message": {"role": "assistant", "content": None}, "logprobs": None,
                                "finish_reason": "error", **failure.body()})
                continue
            logprobs = None
            if modality == "text":
                message = {"role": "assistant", "content": acc.text}
                reason, logprobs = acc.finish_reason, self.logprobs(acc.token_logprobs)
            else:
                audio = await self.audio_object(acc.audio(), acc.text)
                message = {"role": "assistant", "content": None, "audio": audio}
                reason = "stop"
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(acc), **response_metrics(acc.stage_durations)}

    def chunk(self, choices: list[dict[str, Any]], modality: str | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": choices, **extra}
        if modality is not None:
            body["modality"] = modality  # upstream vLLM-Omni marks each chunk with its modality
        return f"data: {json.dumps(body)}\n\n"

    async def event_chunk(self, event: TextEvent | AudioEvent, acc: ResponseTracker,
                          first_audio: bool) -> str | None:
        if isinstance(event, TextEvent):
            i = self.index("text")
            if i is None:  # audio-only request: the text is the transcript, sent with the audio
                return None
            delta = {"content": event.delta} if event.delta else {}
            return self.chunk([{"index": i, "delta": delta, "logprobs": self.logprobs(event.logprobs),
                                "finish_reason": event.finish_reason}], "text")
        i = self.index("audio")
        if i is None:
            return None
        delta: dict[str, Any] = {"role": "assistant"} if first_audio or self.audio_in_content else {}
        if event.samples.size or event.finished:
            audio = await self.audio_object(event.samples, acc.text if event.finished else "", chunk=True)
            if self.audio_in_content:  # upstream vLLM-Omni's shape: the base64 file is the content
                delta["content"] = audio["data"]
            else:
                delta["audio"] = audio
        return self.chunk([{"index": i, "delta": delta, "logprobs": None,
                            "finish_reason": "stop" if event.finished else None}], "audio")


def usage(acc: ResponseTracker) -> dict[str, int]:
    return {"prompt_tokens": acc.prompt_tokens, "completion_tokens": acc.completion_tokens,
            "total_tokens": acc.prompt_tokens + acc.completion_tokens}


class ChatService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _modalities(self, body: ChatCompletionRequest) -> tuple[list[str], list[str]]:
        """-> (what the client gets, what the engine is asked for)."""
        shape = self.ctx.shape
        available = shape.modalities()
        if body.modalities is None:
            requested = [m for m in available if m in ("text", "audio")]
        else:
            missing = sorted(set(body.modalities) - set(available))
            if missing:
                raise APIError(400, f"this model cannot output {missing}; it produces {available}", param="modalities")
            requested = [m for m in available if m in body.modalities]
        if not requested:
            raise APIError(400, f"this model produces {available}, none of which the chat API returns")
        wanted = list(requested)
        # The transcript of the speech is the text stage's output; when that stage runs anyway
        # (it feeds the audio stage) its text is asked for too, so the audio gets a transcript.
        if ("audio" in wanted and "text" not in wanted and "text" in shape.final_types
                and shape.final_types["text"] in shape.upstream[shape.final_types["audio"]]):
            wanted = [m for m in available if m in ("text", "audio")]
        return requested, wanted

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        ctx = self.ctx
        acc = ResponseTracker()  # starts the request's clock (TTFT, e2e)
        model = ctx.check_model(body.model)
        requested, wanted = self._modalities(body)
        audio_format = body.audio.format if body.audio else "wav"
        if "audio" in requested:
            check_format(audio_format)
        params = ctx.sampling_params_list(body)
        messages = [m.to_engine() for m in body.messages]
        ctx.chat.check_media_count(messages)
        ctx.check_prompt_size(chat_text_chars(messages), "messages", len(messages))  # before any media is fetched
        messages = await race_disconnect(raw, resolve_media(messages, ctx.media))
        prompt: dict[str, Any] = {"messages": messages}
        if body.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = body.mm_processor_kwargs
        if ctx.chat.chat_template is not None:
            prompt["chat_template"] = ctx.chat.chat_template
        if body.chat_template_kwargs:
            prompt["chat_template_kwargs"] = body.chat_template_kwargs
        if body.audio is not None and body.audio.voice is not None:
            prompt["speaker"] = body.audio.voice
        ctx.check_stages_up(ctx.shape.needed_stages(wanted))
        ticket = await race_disconnect(raw, ctx.gate.admit())  # a client gone while queued takes no slot
        # vLLM's request id: the X-Request-Id header, else the body's request_id, else a fresh one.
        base_id = raw.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        view = ChatView(f"chatcmpl-{base_id}", model, requested, audio_format, ctx.chat, top_logprobs,
                        ctx.engine.get_tokenizer() if body.logprobs else None)
        note_access(raw, view.request_id, ctx.stage_list(ctx.shape.needed_stages(wanted)), [acc])
        try:
            # Only a streaming client needs the stages' intermediate outputs.
            gen = ctx.engine.generate(prompt, params, request_id=view.request_id, modalities=wanted,
                                      output_partial=bool(body.stream))
            first = await first_output(ctx, raw, gen)
        except BaseException:
            ticket.release()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(raw, view, acc, first, gen, ticket, include_usage)
            return EventStream(stream, raw, partial(_close, ticket, gen))
        failure = None
        try:
            await race_disconnect(raw, _drain(first, gen, acc))
        except BaseException as e:
            err = as_api_error(ctx, e)
            # A later stage failed after an output the client asked for was complete: keep it.
            if not (isinstance(e, RequestFailedError) and any(acc.finished(m) for m in requested)):
                raise err  # noqa: B904 - chained inside as_api_error
            failure = err
        finally:
            ticket.release()
        self.ctx.record_finished(ENDPOINT, acc)
        return JSONResponse(await view.response(acc, failure))

    async def _stream(self, raw: Request, view: ChatView, acc: ResponseTracker, first: OmniRequestOutput,
                      gen: AsyncIterator[OmniRequestOutput], ticket: Ticket, include_usage: bool) -> AsyncIterator[str]:
        status = 200
        try:
            i = view.index("text")
            if i is not None:
                yield view.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}], "text")
            sent_audio = False
            async for out in _chain(first, gen):
                for event in acc.add(out):
                    chunk = await view.event_chunk(event, acc, first_audio=not sent_audio)
                    if chunk is not None:
                        sent_audio = sent_audio or isinstance(event, AudioEvent)
                        yield chunk
            if include_usage:
                yield view.chunk([], usage=usage(acc))
            if acc.stage_durations:
                yield view.chunk([], **response_metrics(acc.stage_durations))
            yield "data: [DONE]\n\n"
            self.ctx.record_finished(ENDPOINT, acc)
        except BaseException as e:  # noqa: BLE001 - a stream's failure can only be reported in-band
            err = engine_error(self.ctx, e)
            if not isinstance(err, APIError):
                status = 499  # cancelled: the client disconnected (AsyncOmni aborted the request)
                raise
            status = err.status
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            ticket.release()
            set_final_status(raw, status)


async def _close(ticket: Ticket, gen: Any) -> None:
    ticket.release()
    await gen.aclose()  # aborts the request in every stage unless it already finished


async def _chain(first: OmniRequestOutput, gen: AsyncIterator[OmniRequestOutput]) -> AsyncIterator[OmniRequestOutput]:
    yield first
    async for out in gen:
        yield out


async def _drain(first: OmniRequestOutput, gen: AsyncIterator[OmniRequestOutput], acc: ResponseTracker) -> None:
    acc.add(first)
    async for out in gen:
        acc.add(out)
