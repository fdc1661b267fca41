"""POST /v1/completions: raw-prompt text generation (OpenAI's legacy completions API).

Meant for text-only pipelines; on a multi-stage pipeline only its text output is produced
(modalities ["text"]), so the stages that only serve other outputs are not run. A batch of
prompts gives one choice per prompt, each an independent request in the pipeline.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai.access_log import note_access
from vllm_omni.entrypoints.openai.response_tracker import ResponseTracker, TextEvent
from vllm_omni.entrypoints.openai.admission import Ticket
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.logprobs import completion_logprobs
from vllm_omni.entrypoints.openai.protocol import CompletionRequest
from vllm_omni.entrypoints.openai.serving_base import (
    EventStream, ServingContext, as_api_error, engine_error, first_output, race_disconnect, response_metrics,
    set_final_status,
)
from vllm_omni.outputs import OmniRequestOutput

ENDPOINT = "/v1/completions"


class CompletionService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw: Request) -> Any:
        ctx = self.ctx
        arrived = time.monotonic()
        model = ctx.check_model(body.model)
        if "text" not in ctx.shape.final_types:
            raise APIError(400, f"this model produces {ctx.shape.modalities()}, not text; use /v1/chat/completions")
        prompts = body.prompts()
        ctx.check_prompt_count(len(prompts))
        for p in prompts:
            ctx.check_prompt_size(len(p.get("prompt", "")), "prompt")
        if body.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt per request", param="prompt")
        params = ctx.sampling_params_list(body)
        ctx.check_stages_up(ctx.shape.needed_stages(["text"]))
        # One admission slot per prompt (each is a request in the stages); a batch larger than
        # the whole gate takes all of it, so it runs alone rather than never.
        slots = min(len(prompts), ctx.gate.max_running)
        tickets = [await race_disconnect(raw, ctx.gate.admit(slots))]
        request_id = f"cmpl-{raw.headers.get('x-request-id') or body.request_id or uuid.uuid4().hex}"  # vLLM's rule
        accs = [ResponseTracker(arrived_at=arrived) for _ in prompts]
        note_access(raw, request_id, ctx.stage_list(ctx.shape.needed_stages(["text"])), accs)
        try:
            if body.stream:
                gen = self._generate(prompts[0], params, request_id, stream=True)
                first = await first_output(ctx, raw, gen)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                stream = self._stream(raw, request_id, model, accs[0], first, gen, tickets, include_usage,
                                      body.logprobs)
                return EventStream(stream, raw, partial(_close, tickets, gen))
            gens = [self._generate(p, params, f"{request_id}-{i}", stream=False) for i, p in enumerate(prompts)]
            await race_disconnect(raw, _all_or_none([self._collect(g, a) for g, a in zip(gens, accs, strict=True)]))
        except BaseException as e:
            _release(tickets)
            raise as_api_error(ctx, e)  # noqa: B904 - chained inside as_api_error
        _release(tickets)
        for acc in accs:
            self.ctx.record_finished(ENDPOINT, acc)
        tokenizer = ctx.engine.get_tokenizer() if body.logprobs is not None else None
        # Each prompt is a pipeline request of its own: its choice carries its stage durations.
        choices = [{"index": i, "text": a.text, "finish_reason": a.finish_reason,
                    "logprobs": None if tokenizer is None else completion_logprobs(tokenizer, a.token_logprobs,
                                                                                   body.logprobs),
                    **response_metrics(a.stage_durations)}
                   for i, a in enumerate(accs)]
        total = _usage(accs)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": model, "choices": choices, "usage": total})

    def _generate(self, prompt: dict[str, Any], params: Any, request_id: str,
                  stream: bool) -> AsyncIterator[OmniRequestOutput]:
        # Only a streaming client needs the text stage's intermediate outputs.
        return self.ctx.engine.generate(prompt, params, request_id=request_id, modalities=["text"],
                                        output_partial=stream)

    @staticmethod
    async def _collect(gen: AsyncIterator[OmniRequestOutput], acc: ResponseTracker) -> None:
        async for out in gen:
            acc.add(out)
        if not acc.text_finished:
            raise APIError(500, "the pipeline ended the request without a text output")

    async def _stream(self, raw: Request, request_id: str, model: str, acc: ResponseTracker,
                      first: OmniRequestOutput, gen: AsyncIterator[OmniRequestOutput], tickets: list[Ticket],
                      include_usage: bool, top_logprobs: int | None) -> AsyncIterator[str]:
        created, status = int(time.time()), 200
        tokenizer = self.ctx.engine.get_tokenizer() if top_logprobs is not None else None
        sent = 0  # characters of text sent: where the next chunk's tokens start

        def choice(event: Any) -> dict[str, Any]:
            nonlocal sent
            assert isinstance(event, TextEvent)  # modalities=["text"]: nothing else comes
            logprobs = None if tokenizer is None else completion_logprobs(tokenizer, event.logprobs, top_logprobs,
                                                                          sent)
            sent += len(event.delta)
            return {"index": 0, "text": event.delta, "logprobs": logprobs, "finish_reason": event.finish_reason}

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        try:
            for event in acc.add(first):
                yield chunk([choice(event)])
            async for out in gen:
                for event in acc.add(out):
                    yield chunk([choice(event)])
            if include_usage:
                yield chunk([], usage=_usage([acc]))
            if acc.stage_durations:
                yield chunk([], **response_metrics(acc.stage_durations))
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
            _release(tickets)
            set_final_status(raw, status)


def _usage(accs: list[ResponseTracker]) -> dict[str, int]:
    prompt = sum(a.prompt_tokens for a in accs)
    completion = sum(a.completion_tokens for a in accs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _all_or_none(coros: list[Any]) -> None:
    """Run the batch's requests together; the first failure (or a cancel) aborts the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()


async def _close(tickets: list[Ticket], gen: Any) -> None:
    _release(tickets)
    await gen.aclose()  # aborts the request in every stage unless it already finished


def _release(tickets: list[Ticket]) -> None:
    for t in tickets:
        t.release()
