"""POST /v1/audio/speech/batch: several texts to speech in one call (upstream vLLM-Omni's route).

    {"model": ..., "items": [{"input": "Hello.", "voice": "alice"}, {"input": "Bye."}],
     "voice": ..., "response_format": "wav", ...}          (batch fields: defaults for every item)
 -> {"id": "speech-batch-...", "results": [{"index": 0, "status": "success", "audio_data": <base64>,
     "media_type": "audio/wav", "usage": {...}}, {"index": 1, "status": "error", "error": "..."}],
     "total": 2, "succeeded": 1, "failed": 1}

Each item is one /v1/audio/speech request (SpeechService.render: the same checks, voices,
admission and engine), all under way at once; an item's failure is its own result, not the
batch's. Items are capped by --speech-batch-max-items (413 beyond); `model` is checked once for
the batch (404). Streaming fields are not batch fields: each result is a whole file.
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.serving_speech import (
    MaxNewTokens, ResponseFormat, SpeechRequest, SpeechService, Speed, TaskType)
from vllm_omni.entrypoints.openai.speech_audio import SPEECH_MEDIA_TYPES


class _Shared(BaseModel):
    """The fields a batch and its items share (an item's own value wins)."""

    model_config = ConfigDict(extra="forbid")

    voice: str | None = None
    instructions: str | None = None
    response_format: ResponseFormat | None = None
    speed: Speed | None = None
    task_type: TaskType | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    non_streaming_mode: bool | None = None
    max_new_tokens: MaxNewTokens | None = None


class BatchItem(_Shared):
    input: str


class BatchSpeechRequest(_Shared):
    model: str | None = None
    items: list[BatchItem] = Field(min_length=1)


DEFAULT_FORMAT = "wav"  # upstream's batch default (a single request's is OpenAI's mp3)


class SpeechBatchService:
    def __init__(self, speech: SpeechService, max_items: int) -> None:
        self.speech, self.max_items = speech, max_items

    async def create(self, body: BatchSpeechRequest, raw: Request) -> dict[str, Any]:
        self.speech.ctx.check_model(body.model)
        if len(body.items) > self.max_items:
            raise APIError(413, f"the batch has {len(body.items)} items; the limit is {self.max_items} "
                                "(--speech-batch-max-items)", param="items")
        shared = body.model_dump(exclude={"items"}, exclude_none=True)
        results = await asyncio.gather(*(self._item(i, shared, item, raw) for i, item in enumerate(body.items)))
        succeeded = sum(r["status"] == "success" for r in results)
        return {"id": f"speech-batch-{uuid.uuid4().hex}", "results": results, "total": len(results),
                "succeeded": succeeded, "failed": len(results) - succeeded}

    async def _item(self, index: int, shared: dict[str, Any], item: BatchItem, raw: Request) -> dict[str, Any]:
        fields = {"response_format": DEFAULT_FORMAT, **shared, **item.model_dump(exclude_none=True)}
        try:
            request = SpeechRequest(**fields)
            audio, usage = await self.speech.render(request, raw)
        except APIError as e:
            return {"index": index, "status": "error", "error": e.message, "code": e.status}
        except ValueError as e:  # a field's value, as the single route's 400 would say
            return {"index": index, "status": "error", "error": str(e), "code": 400}
        return {"index": index, "status": "success", "audio_data": base64.b64encode(audio).decode(),
                "media_type": SPEECH_MEDIA_TYPES[request.response_format], "usage": usage}
