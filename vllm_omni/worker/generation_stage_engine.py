"""`GenerationStageEngine`: one forward pass per batch of queued requests (e.g. code2wav).

A batch that fails is retried one request at a time, so the request that broke it fails
alone. A whole request is `FINAL_ONLY` by nature: its one output is its whole result.

A request whose input streams in (`input_complete=False`, a streaming edge from a talker)
gets a `StreamingDecoder` from the model; its units arrive with `add_input`, and each step
decodes, in one batched call, a chunk of up to max_batch_size requests whose decoders are
ready (round robin among them), sending each chunk on at once with how many units it has
consumed (flow control upstream).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

from vllm_omni.stage_io import (
    STREAM_UNITS_KEY, GenerationModel, StageInputChunk, StageOutput, StageRequest, StreamingDecoder,
    StreamingGenerationModel, error_output,
)

logger = logging.getLogger(__name__)


class GenerationStageEngine:
    def __init__(self, model: GenerationModel, scheduler: OmniGenerationScheduler, *, stage_id: int,
                 device: str = "cpu") -> None:
        self.model = model
        self.scheduler = scheduler
        self.stage_id = stage_id
        self.device = device
        self._ready: list[StageOutput] = []
        self._streams: dict[str, StreamingDecoder] = {}  # requests whose input streams in
        self._no_units: dict[str, torch.Tensor] = {}  # per stream: zero units of its kind, for a bare final
        self._last_turn: dict[str, int] = {}  # per stream: the step that last decoded it (0: none yet)
        self._turns = 0

    def add_request(self, req: StageRequest) -> None:
        try:
            if req.input_complete:
                self.scheduler.add_request(req)
            else:
                self._open_stream(req)
        except ValueError as e:
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {e}"))

    def _open_stream(self, req: StageRequest) -> None:
        if not isinstance(self.model, StreamingGenerationModel):
            raise ValueError(f"{type(self.model).__name__} does not take streamed input")
        if req.request_id in self._streams:
            raise ValueError(f"request {req.request_id} is already streaming into this stage")
        info = dict(req.additional_information)
        units = info.pop(STREAM_UNITS_KEY, None)
        decoder = self.model.open_stream(msgspec.structs.replace(req, additional_information=info))
        if units is not None:
            decoder.push(units, final=False)
            self._no_units[req.request_id] = units[:0]
        self._streams[req.request_id] = decoder
        self._last_turn[req.request_id] = 0

    def add_input(self, chunk: StageInputChunk) -> None:
        decoder = self._streams.get(chunk.request_id)
        if decoder is None:
            return  # finished or aborted meanwhile
        info = dict(chunk.additional_information)
        units = info.pop(STREAM_UNITS_KEY, None)
        try:
            if info:
                raise ValueError(f"a streamed chunk holds only {STREAM_UNITS_KEY!r}, got {sorted(info)}")
            if units is None and chunk.final:
                units = self._no_units.get(chunk.request_id)
                if units is None:
                    raise ValueError("the stream ended before any input arrived")
            if units is not None:
                decoder.push(units, final=chunk.final)
                self._no_units[chunk.request_id] = units[:0]
        except ValueError as e:
            self._close_stream(chunk.request_id)
            self._ready.append(error_output(chunk.request_id, f"stage {self.stage_id}: {e}"))
            return
        if decoder.finished:  # the final chunk brought nothing left to decode
            self._close_stream(chunk.request_id)
            self._ready.append(StageOutput(request_id=chunk.request_id, finished=True, finish_reason="stop",
                                           consumed_units=decoder.consumed))

    def _close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._no_units.pop(request_id, None)
        self._last_turn.pop(request_id, None)

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        """Nothing to pause: this stage feeds no streaming edge."""

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.abort(request_ids)
        for rid in request_ids:
            self._close_stream(rid)

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        # Round robin: the streams decoded longest ago (or never) first, so a long stream that
        # always has a chunk ready cannot hold the batch's slots while the others wait.
        ready = sorted((rid for rid, d in self._streams.items() if d.ready()), key=self._last_turn.__getitem__)
        # First chunks first, in a step of their own: a new stream's first audio (a small window)
        # goes out after one short decode, not after a batch of steady chunks (windows of up to
        # 50 frames) that it would otherwise join. Steady streams still have audio playing.
        first = [rid for rid in ready if self._last_turn[rid] == 0]
        ready = (first or ready)[: self.scheduler.max_batch_size]
        if ready:
            self._turns += 1
            self._last_turn.update(dict.fromkeys(ready, self._turns))
            outputs.extend(self._decode_streams(ready))
        batch = self.scheduler.schedule()
        if batch:
            outputs.extend(self._run(batch))
        return outputs

    def _decode_streams(self, ids: list[str]) -> list[StageOutput]:
        decoders = [self._streams[rid] for rid in ids]
        try:
            results = self._check(ids, self._decode(decoders))
        except Exception as e:  # noqa: BLE001 - isolate the request that broke the batch
            if len(ids) == 1:
                logger.warning("stage %d: request %s failed: %s", self.stage_id, ids[0], e)
                self._close_stream(ids[0])
                return [error_output(ids[0], f"stage {self.stage_id}: {type(e).__name__}: {e}")]
            logger.warning("stage %d: a stream batch of %d failed (%s); retrying one by one", self.stage_id,
                           len(ids), e)
            return [out for rid in ids for out in self._decode_streams([rid])]
        outputs = []
        for rid, decoder, result in zip(ids, decoders, results):
            if decoder.finished:
                self._close_stream(rid)
            outputs.append(StageOutput(request_id=rid, finished=decoder.finished,
                                       finish_reason="stop" if decoder.finished else None,
                                       multimodal_output=result, consumed_units=decoder.consumed))
        return outputs

    @torch.inference_mode()
    def _decode(self, decoders: list[StreamingDecoder]) -> list[dict[str, torch.Tensor]]:
        return self.model.decode_streams(decoders)

    def _run(self, batch: list[StageRequest]) -> list[StageOutput]:
        try:
            results = self._forward(batch)
        except Exception as e:  # noqa: BLE001 - isolate the request that broke the batch
            if len(batch) == 1:
                logger.warning("stage %d: request %s failed: %s", self.stage_id, batch[0].request_id, e)
                return [error_output(batch[0].request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}")]
            logger.warning("stage %d: a batch of %d failed (%s); retrying one by one", self.stage_id, len(batch), e)
            return [out for req in batch for out in self._run([req])]
        return [
            StageOutput(request_id=req.request_id, finished=True, finish_reason="stop", multimodal_output=result)
            for req, result in zip(batch, results)
        ]

    @torch.inference_mode()
    def _forward(self, batch: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        return self._check([req.request_id for req in batch], self.model.generate_batch(batch))

    @staticmethod
    def _check(ids: list[str], results: list) -> list[dict[str, torch.Tensor]]:
        if len(results) != len(ids):
            raise RuntimeError(f"the model returned {len(results)} results for {len(ids)} requests")
        for rid, result in zip(ids, results):
            if not isinstance(result, dict) or not all(isinstance(v, torch.Tensor) for v in result.values()):
                raise TypeError(f"the model must return dict[str, Tensor] per request (request {rid})")
        return results

    def has_work(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished() or any(d.ready() for d in self._streams.values())

    def fail_all(self, error: str) -> list[StageOutput]:
        # _run reports every failure of the batch it ran; queued requests are untouched.
        return []

    def stats(self) -> dict[str, int]:
        waiting = self.scheduler.num_waiting
        return {"num_unfinished": waiting + len(self._streams), "num_waiting": waiting}

    def describe(self) -> dict[str, Any]:
        streams = isinstance(self.model, StreamingGenerationModel)
        return {"engine": "generation", "device": self.device, "max_batch_size": self.scheduler.max_batch_size,
                "accepts_streamed_input": streams,
                "stream_units_per_chunk": self.model.max_units_per_chunk if streams else None}
