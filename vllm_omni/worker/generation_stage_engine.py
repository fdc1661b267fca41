"""`GenerationStageEngine`: one forward pass per batch of queued requests (e.g. code2wav).

A batch that fails is retried one request at a time, so the request that broke it fails
alone. A whole request is `FINAL_ONLY` by nature: its one output is its whole result.

A request whose input streams in (`input_complete=False`, a streaming edge from a talker)
gets a `StreamingDecoder` from the model; its units arrive with `add_input`, and each step
decodes, in one batched call, a chunk of up to max_batch_size requests whose decoders are
ready (earliest playback deadline first, playback_deadlines.py; new streams' first chunks in
calls of their own; no more than the model's `streams_per_step` says: GenerationModel), sending
each chunk on at once with how many units it has consumed (flow control upstream).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.stage_io import (
    STREAM_UNITS_KEY, StageInfo, StageInputChunk, StageOutput, StageRequest, StreamingDecoder, error_output,
)
from vllm_omni.worker.decode_lanes import CudaLanes, HostLanes, Launched, decode_lanes
from vllm_omni.worker.playback_deadlines import StepPlan, StreamDeadlines

logger = logging.getLogger(__name__)

_IN_FLIGHT_POLL_MS = 1


@dataclass(frozen=True)
class _InFlight:
    ids: list[str]
    decoders: list[StreamingDecoder]
    launched: Launched
    at: float  # when it was launched (the deadlines' clock)


class GenerationStageEngine:
    def __init__(self, model: GenerationModel, scheduler: OmniGenerationScheduler, *, stage_id: int,
                 device: str = "cpu", lanes: HostLanes | CudaLanes | None = None,
                 deadlines: StreamDeadlines | None = None) -> None:
        """`lanes`: where stream decodes run (default: `decode_lanes` for the model and device);
        `deadlines`: the streams' playback timelines, which order the decodes."""
        self.model = model
        self.scheduler = scheduler
        self.stage_id = stage_id
        self.device = device
        self._ready: list[StageOutput] = []
        self._streams: dict[str, StreamingDecoder] = {}  # requests whose input streams in
        self._no_units: dict[str, torch.Tensor] = {}  # per stream: zero units of its kind, for a bare final
        self._new: set[str] = set()  # streams whose first chunk no step has taken yet
        self._deadlines = deadlines or StreamDeadlines()
        self._lanes = decode_lanes(device, model) if lanes is None else lanes
        self._in_flight: _InFlight | None = None  # later chunks launched on the GPU, not yet collected

    def add_request(self, req: StageRequest) -> None:
        try:
            if req.input_complete:
                self.scheduler.add_request(req)
            else:
                self._open_stream(req)
        except ValueError as e:
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {e}"))

    def _open_stream(self, req: StageRequest) -> None:
        if not self.model.accepts_streamed_input:
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
        self._deadlines.open(req.request_id)
        self._new.add(req.request_id)

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
        in_flight = self._in_flight is not None and chunk.request_id in self._in_flight.ids
        if decoder.finished and not in_flight:  # the final chunk brought nothing left to decode
            self._close_stream(chunk.request_id)
            self._ready.append(StageOutput(request_id=chunk.request_id, finished=True, finish_reason="stop",
                                           consumed_units=decoder.consumed))

    def _close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._no_units.pop(request_id, None)
        self._deadlines.close(request_id)
        self._new.discard(request_id)

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        """Nothing to pause: this stage feeds no streaming edge."""

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.abort(request_ids)
        for rid in request_ids:
            self._close_stream(rid)

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        if self._in_flight is not None and self._in_flight.launched.done():
            outputs.extend(self._collect())
        # Earliest playback deadline first (playback_deadlines.py). New streams' first chunks go in
        # a call of their own: a first audio (a small window) goes out after one short decode, not
        # after a batch of later chunks (windows of up to 50 frames) that it would otherwise join.
        # Where the lanes overlap (decode_lanes.py), the later chunks run on the GPU meanwhile.
        plan = self._step_plan()
        first = self._plan(plan.first)
        if plan.later:
            outputs.extend(self._launch(self._plan(plan.later)))
        if first:
            began = self._deadlines.clock()
            outputs.extend(self._decode_now(first))
            self._deadlines.timed_call("first", self._deadlines.clock() - began)
        if self._in_flight is not None and self._in_flight.launched.done():
            outputs.extend(self._collect())
        batch = self.scheduler.schedule()
        if batch:
            outputs.extend(self._run(batch))
        return outputs

    def _step_plan(self) -> StepPlan:
        in_flight = self._in_flight.ids if self._in_flight is not None else []
        ready = self._ready_streams()
        per_call = 1  # how many playing streams one call takes: only the margin rule needs it
        if self._deadlines.by_margin:
            playing = [self._streams[rid] for rid in ready if rid not in self._new][: self.scheduler.max_batch_size]
            per_call = self.model.streams_per_step(playing) if playing else 1
        return self._deadlines.plan(ready, self._new, in_flight, can_launch=self._in_flight is None,
                                    overlapping=self._lanes.overlapping, per_call=per_call)

    def _ready_streams(self) -> list[str]:
        busy = self._in_flight.ids if self._in_flight is not None else ()
        return [rid for rid, d in self._streams.items() if d.ready() and rid not in busy]

    def _plan(self, ids: list[str]) -> list[str]:
        """The streams one call takes: the first of `ids` (up to max_batch_size, as many as the
        model runs well)."""
        ids = ids[: self.scheduler.max_batch_size]
        if ids:
            ids = ids[: max(1, self.model.streams_per_step([self._streams[rid] for rid in ids]))]
        self._new.difference_update(ids)
        return ids

    def _decode_now(self, ids: list[str]) -> list[StageOutput]:
        decoders = [self._streams[rid] for rid in ids]
        try:
            results = self._lanes.run_now(lambda: self._decode(ids, decoders))
        except Exception as e:  # noqa: BLE001 - isolate the request that broke the batch
            return self._isolate(ids, e)
        return self._stream_outputs(ids, decoders, results)

    def _launch(self, ids: list[str]) -> list[StageOutput]:
        """Later chunks: on their way (nothing to send yet), or what their failure sends."""
        decoders = [self._streams[rid] for rid in ids]
        try:
            launched = self._lanes.launch(lambda: self._decode(ids, decoders))
        except Exception as e:  # noqa: BLE001 - isolate the request that broke the batch
            return self._isolate(ids, e)
        self._in_flight = _InFlight(ids, decoders, launched, self._deadlines.clock())
        return []

    def _collect(self) -> list[StageOutput]:
        flight, self._in_flight = self._in_flight, None
        self._deadlines.timed_call("later", self._deadlines.clock() - flight.at)
        # Streams aborted meanwhile get nothing; the others' state is as the launch left it.
        live = [i for i, (rid, d) in enumerate(zip(flight.ids, flight.decoders)) if self._streams.get(rid) is d]
        results = flight.launched.results()
        return self._stream_outputs([flight.ids[i] for i in live], [flight.decoders[i] for i in live],
                                    [results[i] for i in live])

    def _isolate(self, ids: list[str], error: Exception) -> list[StageOutput]:
        """A call failed: one stream fails alone; several are retried one by one."""
        if len(ids) == 1:
            logger.warning("stage %d: request %s failed: %s", self.stage_id, ids[0], error)
            self._close_stream(ids[0])
            return [error_output(ids[0], f"stage {self.stage_id}: {type(error).__name__}: {error}")]
        logger.warning("stage %d: a stream batch of %d failed (%s); retrying one by one", self.stage_id,
                       len(ids), error)
        return [out for rid in ids for out in self._decode_now([rid])]

    def _stream_outputs(self, ids: list[str], decoders: list[StreamingDecoder],
                        results: list[dict[str, torch.Tensor]]) -> list[StageOutput]:
        outputs = []
        for rid, decoder, result in zip(ids, decoders, results):
            self._deadlines.record(rid, result)
            if decoder.finished:
                self._close_stream(rid)
            outputs.append(StageOutput(request_id=rid, finished=decoder.finished,
                                       finish_reason="stop" if decoder.finished else None,
                                       multimodal_output=result, consumed_units=decoder.consumed))
        return outputs

    @torch.inference_mode()
    def _decode(self, ids: list[str], decoders: list[StreamingDecoder]) -> list[dict[str, torch.Tensor]]:
        return self._check(ids, self.model.decode_streams(decoders))

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
        if self._ready or self.scheduler.has_unfinished():
            return True
        if self._in_flight is not None:  # then only first chunks can go (if due), or the launch's results
            return self._in_flight.launched.done() or bool(self._step_plan().first)
        return bool(self._ready_streams())

    def poll_ms(self) -> int | None:
        """A decode is on the GPU: the worker looks again this soon (nothing signals its end)."""
        return _IN_FLIGHT_POLL_MS if self._in_flight is not None else None

    def fail_all(self, error: str) -> list[StageOutput]:
        # _run reports every failure of the batch it ran; queued requests are untouched. A
        # decode on the GPU when the step failed (a device error) fails its streams.
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        for rid in flight.ids:
            self._close_stream(rid)
        return [error_output(rid, error) for rid in flight.ids]

    def stats(self) -> dict[str, Any]:
        waiting = self.scheduler.num_waiting
        counts = {"streams": len(self._streams), "ready": len(self._ready_streams()), "new": len(self._new),
                  "on_device": len(self._in_flight.ids) if self._in_flight is not None else 0}
        return {"num_unfinished": waiting + len(self._streams), "num_waiting": waiting, "counts": counts}

    def describe(self) -> StageInfo:
        streams = self.model.accepts_streamed_input
        return StageInfo(engine="generation", device=self.device, max_batch_size=self.scheduler.max_batch_size,
                         accepts_streamed_input=streams,
                         stream_units_per_chunk=self.model.max_units_per_chunk if streams else None)
