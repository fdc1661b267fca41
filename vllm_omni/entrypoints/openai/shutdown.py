"""Graceful shutdown on SIGTERM / SIGINT: every request in flight gets an answer.

    server = GracefulServer(uvicorn.Config(app, ...), ctx, shutdown_timeout_s=30)
    server.run(sockets=[sock])     # returns once the pipeline is closed; nothing is left behind

On the signal, before uvicorn closes its sockets:
1. admission closes: queued and new requests get 503 (JSON), /health answers 503;
2. requests in flight get up to `shutdown_timeout_s` to finish normally;
3. the pipeline closes (stages stopped in order, sockets, shared memory and the IPC folder
   removed); the requests still running end with an OpenAI-shaped 503 (JSON, or an SSE
   error event then [DONE]), since their outputs will never come.
Then uvicorn closes the connections. A second Ctrl-C skips the wait.

uvicorn re-raises the signal once it has shut down (for embedding apps); here everything is
already cleaned up by then, so the process exits normally instead of dying mid-cleanup
(which left `/tmp/vomni-*` folders) or printing a KeyboardInterrupt traceback.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn

from vllm_omni.entrypoints.openai.serving_base import ServingContext

logger = logging.getLogger(__name__)

_FORCE_CHECK_S = 0.1  # how often the wait looks for a second Ctrl-C


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServingContext, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain()
        # A second Ctrl-C has done its job: it cut the wait above. Left set, uvicorn would also
        # skip the app's lifespan shutdown and cancel it, which logs a CancelledError traceback;
        # with the pipeline closed, what uvicorn has left to do is quick. (A third one forces.)
        self.force_exit = False
        await super().shutdown(sockets)
        # Cleaned up already: nothing is left for a re-raised SIGTERM / SIGINT to interrupt.
        # (uvicorn >= 0.29 keeps the signals it caught here; older ones re-raise nothing.)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def _drain(self) -> None:
        ctx = self.ctx
        ctx.shutting_down = True
        ctx.gate.close()
        running = ctx.gate.running
        if running:
            logger.info("shutting down: waiting up to %.0fs for %d request(s) in flight", self.shutdown_timeout_s,
                        running)
        deadline = time.monotonic() + self.shutdown_timeout_s
        while not await ctx.gate.wait_idle(min(_FORCE_CHECK_S, max(0.0, deadline - time.monotonic()))):
            if self.force_exit or time.monotonic() >= deadline:
                logger.warning("shutting down: ending %d request(s) still in flight", ctx.gate.running)
                break
        logger.info("shutting down: stopping the pipeline")
        # Blocking (stage processes are stopped and reaped); the loop goes on writing the
        # answers of the requests the closing pipeline fails.
        await asyncio.to_thread(ctx.engine.close)
