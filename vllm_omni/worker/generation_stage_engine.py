"""`GenerationStageEngine`: one forward pass per batch of queued requests (e.g. code2wav).

A batch that fails is retried one request at a time, so the request that broke it fails
alone. Every request is `FINAL_ONLY` by nature: its one output is its whole result.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.stage_io import GenerationModel, StageOutput, StageRequest, error_output

logger = logging.getLogger(__name__)


class GenerationStageEngine:
    def __init__(self, model: GenerationModel, scheduler: OmniGenerationScheduler, *, stage_id: int,
                 device: str = "cpu") -> None:
        self.model = model
        self.scheduler = scheduler
        self.stage_id = stage_id
        self.device = device
        self._ready: list[StageOutput] = []

    def add_request(self, req: StageRequest) -> None:
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {e}"))

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.abort(request_ids)

    def step(self) -> list[StageOutput]:
        outputs, self._ready = self._ready, []
        batch = self.scheduler.schedule()
        if batch:
            outputs.extend(self._run(batch))
        return outputs

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
        results = self.model.generate_batch(batch)
        if len(results) != len(batch):
            raise RuntimeError(f"generate_batch returned {len(results)} results for {len(batch)} requests")
        for req, result in zip(batch, results):
            if not isinstance(result, dict) or not all(isinstance(v, torch.Tensor) for v in result.values()):
                raise TypeError(f"generate_batch must return dict[str, Tensor] per request (request {req.request_id})")
        return results

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished()

    def fail_all(self, error: str) -> list[StageOutput]:
        # _run reports every failure of the batch it ran; queued requests are untouched.
        return []

    def stats(self) -> dict[str, int]:
        return {"num_unfinished": self.scheduler.num_waiting, "num_waiting": self.scheduler.num_waiting}

    def describe(self) -> dict[str, Any]:
        return {"engine": "generation", "device": self.device, "max_batch_size": self.scheduler.max_batch_size}
