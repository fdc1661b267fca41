"""What the chat and completions endpoints share: the served pipeline's shape, checks that
run before a request is admitted, and starting a generation with client-disconnect handling.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vllm_omni.config.stage_config import ConfigFormat, PipelineConfig
from vllm_omni.engine.pipeline_sleep import PipelineSleepingError
from vllm_omni.engine.stage_client import StageState
from vllm_omni.entrypoints.async_omni import PipelineOverloadedError, RequestFailedError
from vllm_omni.entrypoints.openai.response_tracker import ResponseTracker
from vllm_omni.entrypoints.openai.admission import AdmissionGate
from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE
from vllm_omni.entrypoints.openai.chat_options import ChatOptions
from vllm_omni.entrypoints.openai.errors import APIError, ClientDisconnected, from_request_failure, retry_after
from vllm_omni.entrypoints.openai.input_limits import DEFAULT_DIFFUSION_PROMPT_CHARS
from vllm_omni.entrypoints.openai.metrics import ServerMetrics
from vllm_omni.entrypoints.openai.prompt_limits import PromptLimit
from vllm_omni.entrypoints.openai.protocol import SamplingFields
from vllm_omni.entrypoints.openai.request_params import resolve_sampling_params
from vllm_omni.multimodal.media_policy import MediaPolicy
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PipelineShape:
    """The served pipeline as the API sees it: final outputs and who feeds whom."""

    num_stages: int
    comprehension_stage: int | None  # where the standard sampling parameters apply
    final_types: dict[str, int]  # output type -> the final stage producing it (first one)
    upstream: dict[int, frozenset[int]]  # stage -> every stage it (transitively) depends on
    stage_config_wins: bool = False  # served from a stage config: its sampling values win (sampling_precedence)

    @classmethod
    def of(cls, pipeline: PipelineConfig) -> PipelineShape:
        final: dict[str, int] = {}
        for s in pipeline.stages:
            if s.final_output:
                final.setdefault(s.final_output_type.value, s.stage_id)
        upstream: dict[int, frozenset[int]] = {}
        for sid in pipeline.topo_order():
            srcs = pipeline.stage(sid).engine_input_source
            upstream[sid] = frozenset(srcs).union(*(upstream[s] for s in srcs))
        comp = pipeline.comprehension_stage
        return cls(pipeline.num_stages, comp.stage_id if comp else None, final, upstream,
                   stage_config_wins=pipeline.format is not ConfigFormat.SINGLE_STAGE)

    def modalities(self) -> list[str]:
        """Output types in stage order (choice order of a chat response)."""
        return sorted(self.final_types, key=self.final_types.__getitem__)

    def needed_stages(self, modalities: list[str]) -> set[int]:
        stages: set[int] = set()
        for m in modalities:
            sid = self.final_types[m]
            stages |= {sid, *self.upstream[sid]}
        return stages


@dataclass
class ServingContext:
    engine: Any  # AsyncOmni (the contract in the package docs)
    shape: PipelineShape
    served_names: list[str]
    gate: AdmissionGate
    metrics: ServerMetrics
    media: MediaPolicy
    model_path: str
    stage_names: dict[int, str] = field(default_factory=dict)
    chat: ChatOptions = field(default_factory=ChatOptions)
    max_prompts_per_request: int = 32
    shutting_down: bool = False  # set on SIGTERM / SIGINT (shutdown.py)
    prompt_limit: PromptLimit | None = None  # None: no cheap bound known (no tokenizer)
    max_diffusion_prompt_chars: int = DEFAULT_DIFFUSION_PROMPT_CHARS  # --max-diffusion-prompt-chars

    def precheck_chat(self, body: Any) -> None:
        """On the decoded JSON, before pydantic: more messages than max_model_len cannot fit."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list):
            self.check_prompt_size(0, "messages", len(messages))

    def precheck_completion(self, body: Any) -> None:
        """On the decoded JSON, before pydantic: a batch over the prompt cap is refused unread."""
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            self.check_prompt_count(len(prompt))

    def check_prompt_size(self, chars: int, param: str, num_messages: int = 0) -> None:
        """413 for a prompt too long to fit whatever it tokenizes to (prompt_limits.py)."""
        if self.prompt_limit is not None:
            self.prompt_limit.check(chars, param, num_messages)

    def check_prompt_count(self, n: int) -> None:
        """A request fans out into one pipeline request per prompt; more than the cap is a 400."""
        if n > self.max_prompts_per_request:
            raise APIError(400, f"the request has {n} prompts; this server takes at most "
                                f"{self.max_prompts_per_request} per request (--max-prompts-per-request)",
                           param="prompt")

    def stage_list(self, stages: set[int]) -> list[str]:
        """Stage names in stage order (for the access log)."""
        return [self.stage_names.get(sid, str(sid)) for sid in sorted(stages)]

    def check_model(self, model: str | None) -> str:
        """The served name a request addresses (None: the first one); 404 for any other."""
        if model is None:
            return self.served_names[0]
        if model not in self.served_names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.served_names}",
                           param="model")
        return model

    def check_stages_up(self, stages: set[int]) -> None:
        down = [h for h in self.engine.stage_health() if h.stage_id in stages and h.state != StageState.UP]
        if down:
            what = "; ".join(f"stage {h.stage_id} ({self.stage_names.get(h.stage_id, '?')}) is {h.state.value}: "
                             f"{summarize_reason(h.reason)}" for h in down)
            raise APIError(503, f"a stage this request needs is not serving: {what}", retry_after_s=retry_after(down))

    def record_finished(self, endpoint: str, acc: ResponseTracker) -> None:
        """A finished request's metrics: latency and tokens, time to first text and audio, audio RTF."""
        m = self.metrics
        m.observe_finished(endpoint, time.monotonic() - acc.arrived_at, acc.prompt_tokens, acc.completion_tokens,
                           acc.stage_durations)
        if acc.first_text_at is not None:
            m.ttft.observe(acc.first_text_at - acc.arrived_at)
        if acc.first_audio_at is not None and acc.last_audio_at is not None:
            m.ttfa.observe(acc.first_audio_at - acc.arrived_at)
            for gap in acc.audio_gaps:
                m.audio_gap.observe(gap)
            m.observe_audio(acc.last_audio_at - acc.arrived_at, acc.audio_samples / OUTPUT_SAMPLE_RATE)

    def sampling_params_list(self, body: SamplingFields) -> list[SamplingParams]:
        """One validated SamplingParams per stage (request_params.py): the request's values applied
        as sampling_precedence says, a bad value or one over a stage's max_tokens ceiling a 400
        naming the field, before the request is admitted."""
        return resolve_sampling_params(self.engine.pipeline, body, stage_config_wins=self.shape.stage_config_wins)


async def race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts the request in every stage) if the client goes away.

    Event driven: uvicorn answers `receive()` with http.disconnect the moment the socket closes."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (server shutdown): the work goes too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_output(ctx: ServingContext, request: Request,
                       gen: AsyncIterator[OmniRequestOutput]) -> OmniRequestOutput:
    """Start a generation and wait for its first output, so that bad input, a too-long prompt or
    a down stage become a proper HTTP error instead of a broken stream."""
    try:
        return await race_disconnect(request, _next(gen))
    except StopAsyncIteration:
        raise APIError(500, "the pipeline ended the request without any output") from None
    except BaseException as e:
        raise as_api_error(ctx, e)  # noqa: B904 - chained inside as_api_error


async def _next(gen: AsyncIterator[OmniRequestOutput]) -> OmniRequestOutput:
    return await gen.__anext__()


def as_api_error(ctx: ServingContext, exc: BaseException) -> BaseException:
    """For `raise as_api_error(ctx, e)` in an except block: the mapped error, chained to the
    original; cancellations and disconnects unchanged."""
    err = engine_error(ctx, exc)
    if err is not exc:
        err.__cause__ = exc
    return err


def engine_error(ctx: ServingContext, exc: BaseException) -> BaseException:
    """An exception out of AsyncOmni.generate -> the APIError the client gets."""
    if isinstance(exc, (APIError, ClientDisconnected, asyncio.CancelledError)):
        return exc
    if isinstance(exc, PipelineSleepingError):
        return APIError(503, str(exc))
    if ctx.shutting_down and isinstance(exc, RuntimeError):  # RequestFailedError or "the pipeline is closed"
        return APIError(503, f"the server is shutting down: {exc}")  # its outputs will never come
    if isinstance(exc, PipelineOverloadedError):
        return APIError(429, str(exc), retry_after_s=1.0)
    if isinstance(exc, RequestFailedError):
        return from_request_failure(exc.stage_id, str(exc), ctx.engine.stage_health())
    if isinstance(exc, InvalidParameter):
        return APIError(400, str(exc), param=exc.name)
    if isinstance(exc, ValueError):  # prompt, media, chat template or sampling parameter problems
        return APIError(400, str(exc))
    if isinstance(exc, Exception):
        logger.exception("generation failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return exc


class EventStream(StreamingResponse):
    """An SSE response whose cleanup always runs.

    A client that leaves before the first byte makes Starlette cancel the response before it
    starts the body iterator, so the iterator's `finally` would never run: the request's
    admission slot would leak and its generation would go on until garbage collection.
    Here the iterator is closed and `cleanup` (release the slot, close the engine generator,
    which aborts the request in every stage) runs on every exit path."""

    def __init__(self, body: AsyncIterator[str], request: Request, cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._cleanup = cleanup
        set_final_status(request, 499)  # the stream replaces it with its outcome once it runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                await self._cleanup()


def summarize_reason(reason: str | None) -> str:
    """A stage's DOWN reason on one line: a traceback's heading and its final exception line."""
    lines = [line.strip() for line in (reason or "").strip().splitlines() if line.strip()]
    if not lines:
        return "unknown reason"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def set_final_status(request: Request, status: int) -> None:
    """For streams, whose HTTP status (200) is sent before the outcome is known: the status the
    request metrics record instead (see app.StatusMetricsMiddleware)."""
    request.state.final_status = status


def response_metrics(stage_durations: dict[str, float]) -> dict[str, Any]:
    """The `metrics` member of a response (upstream's stage_durations, seconds by phase); nothing
    when no stage profiles requests, so responses keep OpenAI's shape by default."""
    return {"metrics": {"stage_durations": stage_durations}} if stage_durations else {}
