"""`ARStageEngine`: the stage engine around our AR engine (`core.llm_engine.LLMEngine`).

The engine's outputs are already `StageOutput` deltas; they pass through unchanged (a finished
one's phase durations named for this stage, or dropped when it does not profile). A `DELTA`
request reports every step that produced something, a `FINAL_ONLY` request once, when it
finishes (the engine then builds no intermediate outputs at all). A request whose input
streams in (`input_complete=False`) gets its chunks through `add_input`; its outputs say how
many input rows it has consumed, for the orchestrator's flow control. A request that cannot
run comes back as an error output; nothing here raises for one bad request.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from vllm_omni.stage_io import (
    PROMPT_EMBEDS_KEY, OutputKind, StageInfo, StageInputChunk, StageOutput, StageRequest, error_output,
)

if TYPE_CHECKING:
    from vllm_omni.core.llm_engine import LLMEngine


class ARStageEngine:
    def __init__(self, engine: LLMEngine, *, stage_id: int, export_hidden_states: bool, profile: bool = False) -> None:
        """`profile` (--enable-ar-profiler): a finished output carries the request's queue, prefill
        and decode seconds in this stage (`stage_durations`)."""
        self.engine = engine
        self.stage_id = stage_id
        self.export_hidden_states = export_hidden_states
        self.profile = profile
        self._running: set[str] = set()  # unfinished requests
        self._ready: list[StageOutput] = []  # immediate errors, returned by the next step()

    def add_request(self, req: StageRequest) -> None:
        if req.request_id in self._running:  # the orchestrator's keys are unique; never fail the running one
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: request is already running"))
            return
        try:
            self._add(req)
        except Exception as e:  # noqa: BLE001 - model input parsing included: a bad request fails alone
            self._running.discard(req.request_id)
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}"))

    def _add(self, req: StageRequest) -> None:
        rid = req.request_id
        if req.multi_modal_data:
            raise ValueError("multi_modal_data is not supported by this stage's engine yet")
        info = dict(req.additional_information)
        embeds = info.pop(PROMPT_EMBEDS_KEY, None)
        if embeds is not None and (not isinstance(embeds, torch.Tensor) or embeds.dim() != 2):
            raise ValueError(f"additional_information['{PROMPT_EMBEDS_KEY}'] must be a [prompt_len, hidden] tensor")
        self._running.add(rid)
        # Every other key is the stage model's own input (e.g. a talker's thinker states, a
        # thinker's processed media); the model parses and validates them.
        early = self.engine.add_request(
            rid, req.prompt_token_ids, req.sampling_params, prompt=req.prompt, prompt_embeds=embeds,
            return_hidden_states=self.export_hidden_states, model_inputs=info or None,
            stream=req.output_kind == OutputKind.DELTA, input_complete=req.input_complete,
        )
        if early is not None:
            self._running.discard(rid)
            self._ready.append(early)

    def add_input(self, chunk: StageInputChunk) -> None:
        if chunk.request_id not in self._running:
            return  # finished or aborted meanwhile
        try:
            self.engine.append_inputs(chunk.request_id, chunk.additional_information, chunk.final)
        except Exception as e:  # noqa: BLE001 - a bad chunk fails its request alone
            self.abort([chunk.request_id])
            self._ready.append(error_output(chunk.request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}"))

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        self.engine.pause_requests([rid for rid in request_ids if rid in self._running], paused)

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._running]
        self._running.difference_update(ids)
        if ids:
            self.engine.abort_request(ids)  # frees their KV blocks

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        # has_work, not has_unfinished_requests: a step launched before the last request was aborted
        # is still to be settled (else has_work stays true and the worker loop spins).
        if self.engine.has_work():
            for out in self.engine.step():
                if out.request_id in self._running:
                    outputs.append(self._named_phases(out) if out.finished else out)
                    if out.finished:
                        self._running.discard(out.request_id)
        return outputs

    def has_work(self) -> bool:
        return bool(self._ready) or self.engine.has_work()

    def poll_ms(self) -> None:
        """Nothing to poll for: a step's tokens left on the device count as work (has_work)."""
        return None

    def fail_all(self, error: str) -> list[StageOutput]:
        ids = list(self._running)
        self.abort(ids)
        return [error_output(rid, error) for rid in ids]

    def _named_phases(self, out: StageOutput) -> StageOutput:
        """A finished output's phases (queue, prefill, decode) as this stage's `stage_durations`
        when it profiles (--enable-ar-profiler); none otherwise."""
        phases = {f"ar_stage_{self.stage_id}.{name}": s for name, s in (out.stage_durations or {}).items()}
        return msgspec.structs.replace(out, stage_durations=phases if self.profile else None)

    def stats(self) -> dict[str, Any]:
        bm, s = self.engine.block_manager, self.engine.scheduler
        return {
            "num_unfinished": self.engine.num_unfinished_requests,
            "kv_free_blocks": bm.num_free_blocks,
            "kv_total_blocks": bm.num_blocks,
            "counts": {"running": len(s.running), "waiting": len(s.waiting),
                       "waiting_for_input": len(s.waiting_for_input), "resumable": len(s.resumable)},
        }

    def describe(self) -> StageInfo:
        return StageInfo(
            engine="ar",
            device=str(self.engine.device),
            # Streamed inputs reach rank 0's model only: a tensor-parallel stage takes whole inputs.
            accepts_streamed_input=self.engine.model.accepts_streamed_input
            and self.engine.config.tensor_parallel_size == 1,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,  # callers check prompt token ids against it
            max_batch_size=self.engine.config.max_num_seqs,
            kv_total_blocks=self.engine.block_manager.num_blocks,
            details={"dtype": str(self.engine.dtype)},
        )
