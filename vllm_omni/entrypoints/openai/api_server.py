"""Run the API server: one AsyncOmni, one uvicorn process.

    sock = bind_socket(host, port)          # first: a taken port fails before models load
    engine = AsyncOmni(model, ...)           # blocks until every stage is up (bounded)
    run_server(engine, settings, sock)       # until SIGINT / SIGTERM; then closes the engine
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.engine.serving_stalls import freeze_startup_heap, log_long_pauses
from vllm_omni.entrypoints.openai.admission import AdmissionGate
from vllm_omni.entrypoints.openai.app import build_app
from vllm_omni.entrypoints.openai.chat_options import ChatOptions
from vllm_omni.entrypoints.openai.input_limits import DEFAULT_DIFFUSION_PROMPT_CHARS
from vllm_omni.entrypoints.openai.metrics import ServerMetrics
from vllm_omni.entrypoints.openai.prompt_limits import PromptLimit
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.serving_base import PipelineShape, ServingContext
from vllm_omni.entrypoints.openai.serving_speech import DEFAULT_MAX_INSTRUCTIONS
from vllm_omni.entrypoints.openai.tts_limits import SpeechBatchLimits, SpeechStreamLimits, VoiceLimits
from vllm_omni.entrypoints.openai.video_store import VideoStoreOptions
from vllm_omni.multimodal.media_policy import MediaPolicy

logger = logging.getLogger(__name__)

# After the pipeline closed (shutdown.py), how long uvicorn lets handlers write their answers.
ANSWER_AFTER_CLOSE_S = 10.0


@dataclass(frozen=True)
class ServerSettings:
    model_path: str
    served_names: list[str]
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    admission_timeout_s: float = 10.0  # --batch-timeout
    max_request_bytes: int = 64 * 1024 * 1024
    uvicorn_log_level: str = "info"
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)
    tts_max_instructions_length: int = DEFAULT_MAX_INSTRUCTIONS  # --tts-max-instructions-length
    voices: VoiceLimits = field(default_factory=VoiceLimits)  # --voices-dir, --max-voices, ...
    speech_stream: SpeechStreamLimits = field(default_factory=SpeechStreamLimits)  # --speech-stream-*
    speech_batch: SpeechBatchLimits = field(default_factory=SpeechBatchLimits)  # --speech-batch-max-items
    chat: ChatOptions = field(default_factory=ChatOptions)  # --chat-template, --limit-mm-per-prompt, ...
    log_requests: bool = False  # --enable-log-requests (the access log reads it)
    max_prompts_per_request: int = 32
    shutdown_timeout_s: float = 30.0
    max_diffusion_prompt_chars: int = DEFAULT_DIFFUSION_PROMPT_CHARS
    video: VideoStoreOptions = field(default_factory=VideoStoreOptions)  # --video-store-dir, --video-ttl-s, ...


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def build_context(engine: Any, settings: ServerSettings) -> ServingContext:
    pipeline = engine.pipeline
    names = {s.stage_id: s.model_stage or f"stage{s.stage_id}" for s in pipeline.stages}
    gate = AdmissionGate(settings.max_concurrent_requests, settings.max_queued_requests,
                         settings.admission_timeout_s)
    return ServingContext(engine=engine, shape=PipelineShape.of(pipeline), served_names=list(settings.served_names),
                          gate=gate, metrics=ServerMetrics(names), media=settings.media,
                          model_path=settings.model_path, stage_names=names, chat=settings.chat,
                          max_prompts_per_request=settings.max_prompts_per_request,
                          max_diffusion_prompt_chars=settings.max_diffusion_prompt_chars,
                          prompt_limit=PromptLimit.of(engine))  # the stages are up: they reported it


def run_server(engine: Any, settings: ServerSettings, sock: socket.socket) -> None:
    """Serve until SIGTERM / SIGINT, then shut down gracefully (shutdown.py)."""
    import uvicorn

    from vllm_omni.entrypoints.openai.shutdown import GracefulServer

    ctx = build_context(engine, settings)
    # This process routes every output (the orchestrator's thread) and answers every request:
    # a full collection over its start-up heap would stall both (engine/serving_stalls.py).
    freeze_startup_heap()
    log_long_pauses("api server")
    app = build_app(ctx, api_key=settings.api_key, max_request_bytes=settings.max_request_bytes,
                    realtime=settings.realtime, tts_max_instructions_length=settings.tts_max_instructions_length,
                    video=settings.video, voice_limits=settings.voices, speech_stream=settings.speech_stream,
                    speech_batch=settings.speech_batch)
    # log_config=None: uvicorn logs through the root logger, so --log-file and our format apply.
    # ws_max_size: a realtime event over its limit is refused from its frame header, unread.
    config = uvicorn.Config(app, log_level=settings.uvicorn_log_level, log_config=None,
                            timeout_graceful_shutdown=ANSWER_AFTER_CLOSE_S,
                            access_log=settings.uvicorn_log_level == "debug",
                            ws_max_size=settings.realtime.max_event_bytes)
    server = GracefulServer(config, ctx, settings.shutdown_timeout_s)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s as %s on http://%s:%d", settings.model_path, settings.served_names, host, port)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()  # already closed after a signal; not after a failure


def local_media_root(path: str | None) -> Path | None:
    if path is None:
        return None
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"--allowed-local-media-path {path!r} is not a directory")
    return root
