"""`ARStageEngine`: the stage engine around our AR engine (`core.llm_engine.LLMEngine`).

It turns the engine's cumulative `RequestOutput`s into `StageOutput` deltas: a `DELTA`
request reports every step that produced something, a `FINAL_ONLY` request once, when it
finishes (the engine then builds no intermediate outputs at all). A request whose input
streams in (`input_complete=False`) gets its chunks through `add_input` and reports how many
of its output tokens it has made (each consumed one streamed row) for the orchestrator's flow
control. A request that cannot run comes back as an error output; nothing here raises for
one bad request.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.stage_io import (
    PROMPT_EMBEDS_KEY, OutputKind, StageInputChunk, StageOutput, StageRequest, error_output,
)

if TYPE_CHECKING:
    from vllm_omni.core.llm_engine import LLMEngine
    from vllm_omni.outputs import RequestMetrics, RequestOutput


@dataclass
class _Sent:
    """How much of a request's cumulative output has already gone out as deltas."""

    tokens: int = 0
    text: int = 0
    logprobs: int = 0
    hold_back: int = 0  # trailing characters a later stop string could still cut off
    streamed_input: bool = False  # its input streams in: report consumption for flow control


class ARStageEngine:
    def __init__(self, engine: LLMEngine, *, stage_id: int, export_hidden_states: bool, profile: bool = False) -> None:
        """`profile` (--enable-ar-profiler): a finished output carries the request's queue, prefill
        and decode seconds in this stage (`stage_durations`)."""
        self.engine = engine
        self.stage_id = stage_id
        self.export_hidden_states = export_hidden_states
        self.profile = profile
        self._sent: dict[str, _Sent] = {}  # unfinished requests
        self._ready: list[StageOutput] = []  # immediate errors, returned by the next step()

    def add_request(self, req: StageRequest) -> None:
        if req.request_id in self._sent:  # the orchestrator's keys are unique; never fail the running one
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: request is already running"))
            return
        try:
            self._add(req)
        except Exception as e:  # noqa: BLE001 - model input parsing included: a bad request fails alone
            self._sent.pop(req.request_id, None)
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}"))

    def _add(self, req: StageRequest) -> None:
        rid = req.request_id
        if req.multi_modal_data:
            raise ValueError("multi_modal_data is not supported by this stage's engine yet")
        info = dict(req.additional_information)
        embeds = info.pop(PROMPT_EMBEDS_KEY, None)
        if embeds is not None and (not isinstance(embeds, torch.Tensor) or embeds.dim() != 2):
            raise ValueError(f"additional_information['{PROMPT_EMBEDS_KEY}'] must be a [prompt_len, hidden] tensor")
        params = req.sampling_params
        hold = 0
        if params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.stop) - 1
        self._sent[rid] = _Sent(hold_back=hold, streamed_input=not req.input_complete)
        # Every other key is the stage model's own input (e.g. a talker's thinker states, a
        # thinker's processed media); the model parses and validates them.
        early = self.engine.add_request(
            rid, req.prompt_token_ids, params, prompt=req.prompt, prompt_embeds=embeds,
            return_hidden_states=self.export_hidden_states, model_inputs=info or None,
            stream=req.output_kind == OutputKind.DELTA, input_complete=req.input_complete,
        )
        if early is not None:
            self._ready.append(self._delta(early))

    def add_input(self, chunk: StageInputChunk) -> None:
        if chunk.request_id not in self._sent:
            return  # finished or aborted meanwhile
        try:
            self.engine.append_inputs(chunk.request_id, chunk.additional_information, chunk.final)
        except Exception as e:  # noqa: BLE001 - a bad chunk fails its request alone
            self.abort([chunk.request_id])
            self._ready.append(error_output(chunk.request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}"))

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        self.engine.pause_requests([rid for rid in request_ids if rid in self._sent], paused)

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = [rid for rid in request_ids if self._sent.pop(rid, None) is not None]
        if ids:
            self.engine.abort_request(ids)  # frees their KV blocks

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        # has_work, not has_unfinished_requests: a step launched before the last request was aborted
        # is still to be settled (else has_work stays true and the worker loop spins).
        if self.engine.has_work():
            outputs.extend(self._delta(o) for o in self.engine.step() if o.request_id in self._sent)
        return outputs

    def has_work(self) -> bool:
        return bool(self._ready) or self.engine.has_work()

    def fail_all(self, error: str) -> list[StageOutput]:
        ids = list(self._sent)
        self.abort(ids)
        return [error_output(rid, error) for rid in ids]

    def _delta(self, out: RequestOutput) -> StageOutput:
        comp = out.outputs[0]
        sent = self._sent[out.request_id]
        text_end = len(comp.text) if out.finished else max(sent.text, len(comp.text) - sent.hold_back)
        delta = StageOutput(
            request_id=out.request_id,
            finished=out.finished,
            new_token_ids=comp.token_ids[sent.tokens:],
            new_text=comp.text[sent.text:text_end],
            new_logprobs=comp.logprobs[sent.logprobs:] if comp.logprobs is not None else None,
            cumulative_logprob=comp.cumulative_logprob,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
            # What the engine captured or the model made since the previous output.
            multimodal_output=dict(comp.multimodal_output),
            error=out.error,
            consumed_units=len(comp.token_ids) if sent.streamed_input else None,
            stage_durations=phase_durations(self.stage_id, out.metrics) if self.profile and out.metrics else None,
        )
        sent.tokens, sent.text = len(comp.token_ids), text_end
        sent.logprobs = len(comp.logprobs) if comp.logprobs is not None else 0
        if out.finished:
            del self._sent[out.request_id]
        return delta

    def stats(self) -> dict[str, int]:
        bm = self.engine.block_manager
        return {
            "num_unfinished": self.engine.num_unfinished_requests,
            "kv_free_blocks": bm.num_free_blocks,
            "kv_total_blocks": bm.num_blocks,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "ar",
            # Streamed inputs reach rank 0's model only: a tensor-parallel stage takes whole inputs.
            "accepts_streamed_input": self.engine.model.accepts_streamed_input
            and self.engine.config.tensor_parallel_size == 1,
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype),
            "max_model_len": self.engine.max_model_len,
            "kv_total_blocks": self.engine.block_manager.num_blocks,
            "vocab_size": self.engine.vocab_size,  # callers check prompt token ids against it
        }


def phase_durations(stage_id: int, m: RequestMetrics) -> dict[str, float]:
    """Seconds from arrival to the first step that computed the request (queue), from there to its
    first token (prefill) and from that token to the end (decode): the phases it reached."""
    key = f"ar_stage_{stage_id}"
    durations: dict[str, float] = {}
    if m.first_scheduled_time is not None:
        durations[f"{key}.queue"] = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            durations[f"{key}.prefill"] = m.first_token_time - m.first_scheduled_time
            durations[f"{key}.decode"] = m.finished_time - m.first_token_time
    return durations
