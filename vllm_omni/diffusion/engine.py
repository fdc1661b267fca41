"""`DiffusionEngine`: a diffusion stage that runs ONE denoising step per `step()` call.

Each step the running batch (requests with the same batch key, see scheduler.py) makes one
denoiser forward (conditional and unconditional rows together, denoise.py), every request
advances one flow-matching step on its own schedule, and finished requests are decoded into
images. New requests join the batch at the next step boundary, whatever step the others are
at; an abort removes a request between steps and frees its slot for the next one.

A request that cannot start (bad image, size over the limit) fails alone; a failed forward
fails the requests of that batch and the engine serves the next ones.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni.diffusion.denoise import Cache, Denoiser
from vllm_omni.diffusion.profiler import DECODE, DIFFUSE, ENCODE, PipelineProfiler, timed
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.scheduler import DiffusionScheduler
from vllm_omni.diffusion.tea_cache import TeaCache
from vllm_omni.model_executor.models.diffusion_model import DiffusionModel
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageInfo, StageInputChunk, StageOutput, StageRequest, error_output

logger = logging.getLogger(__name__)


class DiffusionEngine:
    def __init__(self, model: DiffusionModel, *, stage_id: int, max_batch_size: int, device: str = "cpu",
                 cache: Cache | None = None, group: Any = None, max_image_pixels: int | None = None,
                 profile: bool = False) -> None:
        """`profile` (enable_diffusion_pipeline_profiler): finished outputs carry their phases' seconds."""
        self.model = model
        self.stage_id = stage_id
        self.device = device
        self.cache = cache
        self.group = group  # process_group.DiffusionProcessGroup: the stage's other ranks, or None
        self.max_image_pixels = max_image_pixels  # --max-generated-image-size (height * width)
        self.scheduler = DiffusionScheduler(max_batch_size)
        self.denoiser = Denoiser(model, cache, group)
        self.steps_done = 0  # request-steps denoised since start (/metrics)
        self._ready: list[StageOutput] = []
        self.profiler = PipelineProfiler(model.describe()["pipeline"], device) if profile else None

    # --- StageEngine ----------------------------------------------------------------------
    def add_request(self, req: StageRequest) -> None:
        params = req.sampling_params
        if not isinstance(params, DiffusionSamplingParams):
            self._fail(req.request_id, "a diffusion stage needs DiffusionSamplingParams, got "
                                       f"{type(params).__name__}")
            return
        if params.height is not None and params.width is not None and self._too_large(params.height, params.width):
            self._fail(req.request_id, self._size_error(params.height, params.width))
            return
        self.scheduler.add(DiffusionRequest(req, params))

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.abort(request_ids)
        self.denoiser.retain(self.scheduler.running)
        for rid in request_ids:
            self._durations(rid)

    @torch.inference_mode()
    def step(self) -> list[StageOutput]:
        self.scheduler.admit(self._prepare)
        running = list(self.scheduler.running)
        if running:
            self._denoise(running)
        outputs, self._ready = self._ready, []
        return outputs

    def add_input(self, chunk: StageInputChunk) -> None:
        # The orchestrator streams only into stages that say they take streamed input.
        self._ready.append(error_output(chunk.request_id, "a diffusion stage takes no streamed input"))

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        """Nothing to pause: a diffusion stage feeds no streaming edge."""

    def poll_ms(self) -> None:
        return None  # every step finishes its work on the device

    def has_work(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished()

    def fail_all(self, error: str) -> list[StageOutput]:
        cleared = self.scheduler.clear_running()
        for r in cleared:
            self._durations(r.request_id)
        outputs = [error_output(r.request_id, error) for r in cleared]
        outputs += self._ready
        self._ready = []
        return outputs

    def stats(self) -> dict[str, int]:
        s = self.scheduler
        return {"num_unfinished": s.num_waiting + s.num_running, "num_waiting": s.num_waiting,
                "num_running": s.num_running, "diffusion_steps": self.steps_done}

    def describe(self) -> StageInfo:
        return StageInfo(engine="diffusion", device=self.device, max_batch_size=self.scheduler.max_batch_size,
                         video=self.model.video_info(),
                         details={"tea_cache": isinstance(self.cache, TeaCache), "cache_backend": _cache_name(self.cache),
                                  "parallel": self.group.layout.describe() if self.group else {"world_size": 1},
                                  **self.model.describe()})

    # --- internals ------------------------------------------------------------------------
    def _prepare(self, r: DiffusionRequest) -> bool:
        try:
            with timed(self.profiler, ENCODE, [r.request_id]):
                prepared = self.model.prepare(r.request, r.params)
        except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
            logger.warning("stage %d: request %s cannot start: %s", self.stage_id, r.request_id, e)
            # ValueError is a model's "this request cannot run"; anything else is named.
            self._fail(r.request_id, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
            return False
        if self._too_large(prepared.height, prepared.width):
            self._fail(r.request_id, self._size_error(prepared.height, prepared.width))
            return False
        r.start(prepared)
        return True

    def _denoise(self, running: list[DiffusionRequest]) -> None:
        try:
            with timed(self.profiler, DIFFUSE, [r.request_id for r in running]):
                velocities = self.denoiser.velocities(running)
                for r, v in zip(running, velocities):
                    r.advance(v)
        except Exception as e:  # noqa: BLE001 - the batch fails; the engine serves the next requests
            logger.exception("stage %d: a denoising step of %d requests failed", self.stage_id, len(running))
            for r in self.scheduler.clear_running():
                self._fail(r.request_id, f"denoising failed: {type(e).__name__}: {e}")
            return
        self.steps_done += len(running)
        finished = [r for r in running if r.finished]
        if finished:
            self.scheduler.finish(finished)
            self.denoiser.retain(self.scheduler.running)
            self._decode(finished)

    def _decode(self, finished: list[DiffusionRequest]) -> None:
        try:
            prepared, latents = [r.prepared for r in finished], [r.latents for r in finished]
            with timed(self.profiler, DECODE, [r.request_id for r in finished]):
                results = self.group.decode(self.model.decode, prepared, latents) if self.group else \
                    self.model.decode(prepared, latents)
        except Exception as e:  # noqa: BLE001 - these requests fail; the others go on
            logger.exception("stage %d: decoding %d images failed", self.stage_id, len(finished))
            for r in finished:
                self._fail(r.request_id, f"decoding failed: {type(e).__name__}: {e}")
            return
        for r, result in zip(finished, results):
            self._ready.append(StageOutput(request_id=r.request_id, finished=True, finish_reason="stop",
                                           multimodal_output=result, stage_durations=self._durations(r.request_id)))

    def _fail(self, request_id: str, error: str) -> None:
        self._durations(request_id)
        self._ready.append(error_output(request_id, f"stage {self.stage_id}: {error}"))

    def _durations(self, request_id: str) -> dict[str, float] | None:
        return self.profiler.pop(request_id) if self.profiler is not None else None

    def _too_large(self, height: int, width: int) -> bool:
        return self.max_image_pixels is not None and height * width > self.max_image_pixels

    def _size_error(self, height: int, width: int) -> str:
        return (f"the image size {width}x{height} ({height * width} pixels) is over max_generated_image_size="
                f"{self.max_image_pixels}")


def _cache_name(cache: Cache | None) -> str:
    return "none" if cache is None else "tea_cache" if isinstance(cache, TeaCache) else "cache_dit"
