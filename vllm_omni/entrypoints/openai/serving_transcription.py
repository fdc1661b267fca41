"""POST /v1/audio/transcriptions and /v1/audio/translations: speech recognition by the thinker.

OpenAI's shape: a multipart form with `file` (any format FFmpeg decodes), `model`, `prompt`,
`response_format` (json, text, verbose_json, srt, vtt), `temperature`; transcriptions also
take `language` (ISO-639-1) and `stream` (SSE `transcript.text.delta` / `transcript.text.done`).
The thinker runs alone (modalities ["text"]: no talker, no vocoder) on a transcription prompt:
the ASR system prompt and instruction the Qwen Omni models were trained with. The model gives
no timestamps, so verbose_json, srt and vtt hold one segment spanning the whole audio.
"""
from __future__ import annotations

import asyncio
import json
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.media_fetch import count_upload
from vllm_omni.entrypoints.openai.serving_base import (
    EventStream, ServingContext, as_api_error, engine_error, first_output, race_disconnect, set_final_status,
)
from vllm_omni.multimodal.media import AUDIO_SAMPLE_RATE, MediaError, MediaPolicy, load_audio
from vllm_omni.outputs import OmniRequestOutput

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# ISO-639-1 codes -> the language names the instruction uses (the languages Qwen Omni lists).
LANGUAGES = {
    "en": "English", "zh": "Chinese", "yue": "Cantonese", "es": "Spanish", "fr": "French", "de": "German",
    "it": "Italian", "pt": "Portuguese", "ru": "Russian", "ja": "Japanese", "ko": "Korean", "ar": "Arabic",
    "nl": "Dutch", "tr": "Turkish", "vi": "Vietnamese", "th": "Thai", "id": "Indonesian", "ms": "Malay",
    "hi": "Hindi", "ur": "Urdu", "pl": "Polish", "cs": "Czech", "sv": "Swedish", "da": "Danish", "fi": "Finnish",
    "el": "Greek", "hu": "Hungarian", "ro": "Romanian", "uk": "Ukrainian", "he": "Hebrew", "fa": "Persian",
    "fil": "Filipino", "mk": "Macedonian",
}
_FIELDS = {"transcribe": {"file", "model", "language", "prompt", "response_format", "temperature", "stream",
                          "timestamp_granularities[]", "timestamp_granularities"},
           "translate": {"file", "model", "prompt", "response_format", "temperature"}}


@dataclass(frozen=True)
class AudioTask:
    task: str  # "transcribe" | "translate"
    model: str
    wave: Any  # float32 mono at 16 kHz
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool

    @property
    def duration(self) -> float:
        return self.wave.size / AUDIO_SAMPLE_RATE

    def messages(self) -> list[dict[str, Any]]:
        if self.task == "translate":
            system, ask = "You are a speech translation model.", "Translate the audio into English text."
        else:
            lang = f"{LANGUAGES[self.language]} " if self.language else ""
            system, ask = "You are a speech recognition model.", f"Transcribe the {lang}audio into text."
        if self.prompt:  # OpenAI: text that guides the style or continues a previous segment
            ask += f" Context: {self.prompt}"
        return [{"role": "system", "content": system},
                {"role": "user", "content": [(self.wave, AUDIO_SAMPLE_RATE), {"type": "text", "text": ask}]}]


class TranscriptionService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def parse(self, raw: Request, task: str) -> AudioTask:
        form = await raw.form()
        unknown = sorted(set(form.keys()) - _FIELDS[task])
        if unknown:
            raise APIError(400, f"unsupported parameter {unknown[0]!r}", param=unknown[0])
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "'file' (an audio file, multipart/form-data) is required", param="file")
        model = self.ctx.check_model(_text(form, "model"))
        language = _text(form, "language")
        if language is not None and language.lower() not in LANGUAGES:
            raise APIError(400, f"unsupported language {language!r}; use an ISO-639-1 code of {sorted(LANGUAGES)}",
                           param="language")
        fmt = _text(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise APIError(400, f"response_format must be one of {list(FORMATS)}, got {fmt!r}", param="response_format")
        stream = _flag(form, "stream")
        if stream and fmt not in ("json", "text"):
            raise APIError(400, f"stream is not available with response_format {fmt!r}", param="stream")
        granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
        if "word" in granularities:
            raise APIError(400, "word timestamps are not available from this model", param="timestamp_granularities")
        data = await upload.read()
        count_upload(len(data), self.ctx.media)
        try:
            wave = await race_disconnect(raw, _decode(data, self.ctx.media))
        except MediaError as e:
            raise APIError(400, f"cannot decode the audio file: {e}", param="file") from None
        if wave.size == 0:
            raise APIError(400, "the audio file holds no samples", param="file")
        return AudioTask(task, model, wave, language.lower() if language else None, _text(form, "prompt"), fmt,
                         _temperature(form), stream)

    async def create(self, raw: Request, task: str) -> Response:
        ctx = self.ctx
        job = await self.parse(raw, task)
        if ctx.shape.comprehension_stage is None:
            raise APIError(400, "this model has no comprehension (thinker) stage to transcribe with")
        ctx.check_stages_up(ctx.shape.needed_stages(["text"]))
        params: list[dict[str, Any] | None] = [None] * ctx.shape.num_stages
        params[ctx.shape.comprehension_stage] = {"temperature": job.temperature, "logprobs": 0}
        ticket = await race_disconnect(raw, ctx.gate.admit())
        request_id = f"trsc-{uuid.uuid4().hex}"
        try:
            gen = ctx.engine.generate({"messages": job.messages()}, params, request_id=request_id,
                                      modalities=["text"], output_partial=job.stream)
            first = await first_output(ctx, raw, gen)
        except BaseException:
            ticket.release()
            raise
        if job.stream:
            return EventStream(_sse(ctx, raw, first, gen), raw, partial(_close, ticket, gen))
        try:
            last = await race_disconnect(raw, _last(first, gen))
        except BaseException as e:
            raise as_api_error(ctx, e)  # noqa: B904 - chained inside as_api_error
        finally:
            ticket.release()
        return render(job, last)


def _text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"'{key}' must be a text field", param=key)
    return value or None


def _flag(form: FormData, key: str) -> bool:
    value = (_text(form, key) or "false").lower()
    if value not in ("true", "false"):
        raise APIError(400, f"'{key}' must be true or false", param=key)
    return value == "true"


def _temperature(form: FormData) -> float:
    value = _text(form, "temperature")
    try:
        t = float(value) if value is not None else 0.0
    except ValueError:
        t = -1.0
    if not 0.0 <= t <= 2.0:
        raise APIError(400, f"temperature must be a number in [0, 2], got {value!r}", param="temperature")
    return t


async def _decode(data: bytes, policy: MediaPolicy) -> Any:
    """Off the event loop; the duration limit stops the decoder, however long the file says it is."""
    return await asyncio.to_thread(load_audio, data, policy)


async def _last(first: OmniRequestOutput, gen: AsyncIterator[OmniRequestOutput]) -> OmniRequestOutput:
    last = first
    async for out in gen:
        last = out
    return last


def _usage(out: OmniRequestOutput) -> dict[str, Any]:
    ro = out.request_output
    n_in, n_out = len(ro.prompt_token_ids), len(ro.outputs[0].token_ids)
    return {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def render(job: AudioTask, out: OmniRequestOutput) -> Response:
    comp = out.request_output.outputs[0]
    text = comp.text.strip()
    if job.response_format == "text":
        return PlainTextResponse(text)
    if job.response_format == "srt":
        return PlainTextResponse(f"1\n{_timestamp(0, ',')} --> {_timestamp(job.duration, ',')}\n{text}\n\n")
    if job.response_format == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(job.duration, '.')}\n{text}\n\n",
                                 media_type="text/vtt")
    if job.response_format == "json":
        return JSONResponse({"text": text, "usage": _usage(out)})
    n = max(1, len(comp.token_ids))
    raw = text.encode("utf-8")
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": round(job.duration, 3), "text": text,
               "tokens": list(comp.token_ids), "temperature": job.temperature,
               "avg_logprob": (comp.cumulative_logprob or 0.0) / n,
               # Whisper's measure of repetition: text bytes / zlib-compressed bytes.
               "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0,
               "no_speech_prob": None}  # the model has no such estimate
    language = LANGUAGES[job.language].lower() if job.language else ("english" if job.task == "translate" else None)
    return JSONResponse({"task": job.task, "language": language, "duration": round(job.duration, 3), "text": text,
                         "segments": [segment], "usage": {"type": "duration", "seconds": round(job.duration, 3)}})


async def _sse(ctx: ServingContext, raw: Request, first: OmniRequestOutput,
               gen: AsyncIterator[OmniRequestOutput]) -> AsyncIterator[str]:
    out, status = first, 200
    try:
        while True:
            if out.delta is not None and out.delta.text:
                yield _event({"type": "transcript.text.delta", "delta": out.delta.text})
            if out.finished:
                break
            out = await gen.__anext__()
        yield _event({"type": "transcript.text.done", "text": out.request_output.outputs[0].text.strip(),
                      "usage": _usage(out)})
    except BaseException as e:  # noqa: BLE001 - a stream's failure can only be reported in-band
        err = engine_error(ctx, e)
        if not isinstance(err, APIError):
            status = 499  # cancelled: the client disconnected (AsyncOmni aborted the request)
            raise
        status = err.status
        yield _event(err.body())
    finally:
        set_final_status(raw, status)  # what the access log and /metrics record for this stream
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _close(ticket: Any, gen: Any) -> None:
    ticket.release()
    await gen.aclose()
