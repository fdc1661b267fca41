"""One access-log line per request, written when its response (a whole stream included) ends.

    note_access(request, request_id, stages, trackers)   # by a generation endpoint
    -> INFO vllm_omni.access: 127.0.0.1:50312 "POST /v1/chat/completions" 200 0.412s
       id=chatcmpl-1f3a... tokens_in=118 tokens_out=8 audio_s=0.21 stages=thinker,talker,code2wav

Logged by app.StatusMetricsMiddleware, which sees every request's final status (a stream's
in-band error included). Generation routes log at INFO; probes (`GET /health`, `/metrics`,
`/version`, `/v1/models`) at DEBUG, so a load balancer polling every second does not drown
the log. uvicorn's own access log stays off: this line says more.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from vllm_omni.entrypoints.openai.response_tracker import ResponseTracker
from vllm_omni.entrypoints.openai.audio import OUTPUT_SAMPLE_RATE

logger = logging.getLogger("vllm_omni.access")

_PROBES = ("/health", "/metrics", "/version", "/v1/models")
_STATE_KEY = "access"


@dataclass
class AccessRecord:
    request_id: str
    stages: Sequence[str]
    trackers: Sequence[ResponseTracker]  # read when the request ends: final counts


def note_access(request: Request, request_id: str, stages: Iterable[str],
                trackers: Sequence[ResponseTracker]) -> None:
    setattr(request.state, _STATE_KEY, AccessRecord(request_id, list(stages), trackers))


def log_access(scope: dict[str, Any], status: int, latency_s: float) -> None:
    path = scope.get("path", "")
    level = logging.DEBUG if path in _PROBES else logging.INFO
    if not logger.isEnabledFor(level):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    line = f'{who} "{scope.get("method", "-")} {path}" {status} {latency_s:.3f}s'
    record = scope.get("state", {}).get(_STATE_KEY)
    if isinstance(record, AccessRecord):
        accs = record.trackers
        audio_s = sum(a.audio_samples for a in accs) / OUTPUT_SAMPLE_RATE
        line += (f" id={record.request_id} tokens_in={sum(a.prompt_tokens for a in accs)} "
                 f"tokens_out={sum(a.completion_tokens for a in accs)} audio_s={audio_s:.2f} "
                 f"stages={','.join(record.stages)}")
    logger.log(level, line)
