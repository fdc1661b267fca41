"""/v1/videos (OpenAI's Videos API) on a video diffusion stage (Wan2.2): video generation jobs.

    video = client.videos.create(model=..., prompt="a fox running in the snow", size="832x480",
                                 seconds="4", extra_body={"num_inference_steps": 40, "seed": 7})
    while client.videos.retrieve(video.id).status in ("queued", "in_progress"): time.sleep(1)
    client.videos.download_content(video.id).write_to_file("fox.mp4")

POST /v1/videos validates the request (400 naming the parameter), takes an admission slot (429
when the server is full) and answers at once with the job ("queued"); the job runs in the
background ("in_progress", then "completed" or "failed" with an `error`) and its MP4 goes to
the video store (video_store.py). GET /v1/videos/{id} reports it, GET .../content returns the
MP4 (409 before it is done), GET /v1/videos lists jobs (after / limit / order), DELETE removes
one (aborting it while it runs). An unknown id is a 404. `progress` is 0 until the video is
done: the stage reports no progress per step.

The frame rate and the frame-count rule come from the stage (its model's describe(): Wan2.2
A14B 16 fps, TI2V-5B 24, 4k + 1 frames): `seconds` at that rate (or `fps`) gives the frame
count, or `num_frames` directly.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import FileResponse
from pydantic import ValidationError

from vllm_omni.config.stage_config import WorkerType
from vllm_omni.entrypoints.openai.admission import Ticket
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.input_limits import DEFAULT_GENERATED_IMAGE_PIXELS
from vllm_omni.entrypoints.openai.media_fetch import count_upload, resolve_media
from vllm_omni.entrypoints.openai.serving_base import ServingContext, engine_error
from vllm_omni.entrypoints.openai.video_request import VideoJob, VideoRequest
from vllm_omni.entrypoints.openai.video_store import VideoStore, VideoStoreOptions
from vllm_omni.multimodal.media import MediaError, load_image
from vllm_omni.multimodal.video_output import DEFAULT_FPS, write_mp4
from vllm_omni.sampling_params import DiffusionSamplingParams

logger = logging.getLogger(__name__)
VIDEOS = "/v1/videos"
DEFAULT_FRAME_STEP = 1  # a video stage that does not say (the diffusers adapter): any frame count
MAX_LIST_LIMIT = 100
_API_NAME = {"height": "size", "width": "size"}  # DiffusionSamplingParams field -> API parameter


class VideoService:
    def __init__(self, ctx: ServingContext, options: VideoStoreOptions) -> None:
        self.ctx = ctx
        self.options = options
        stages = [s for s in ctx.engine.pipeline.stages if s.worker_type == WorkerType.DIFFUSION]
        self.stage = stages[0] if stages and "video" in ctx.shape.final_types else None
        self.store = VideoStore(options) if self.stage is not None else None
        self.jobs: dict[str, VideoJob] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # --- routes ----------------------------------------------------------------------------
    async def create(self, raw: Request) -> dict[str, Any]:
        self._expire()
        body, upload = await _read_body(raw)
        model = self.ctx.check_model(body.model)
        if self.stage is None:
            raise APIError(400, f"this model produces {self.ctx.shape.modalities()}, not videos")
        info = self.ctx.engine.stage_info(self.stage.stage_id)
        fps = body.fps or info.get("fps", DEFAULT_FPS)
        frames = body.frame_count(fps, info.get("frame_step", DEFAULT_FRAME_STEP),
                                  self.stage.default_sampling_params.num_frames)
        params = self._params(body, frames, info.get("size_multiple", 1))
        prompt: dict[str, Any] = {"prompt": body.prompt}
        if body.negative_prompt is not None:
            prompt["negative_prompt"] = body.negative_prompt
        image = await self._reference_image(body, upload, info.get("image_input", "optional"))
        if image is not None:
            prompt["multi_modal_data"] = {"image": image}
        self.ctx.check_stages_up(self.ctx.shape.needed_stages(["video"]))
        ticket = await self.ctx.gate.admit()
        size = f"{params.width}x{params.height}" if params.width else info.get("default_size", "unknown")
        job = VideoJob(model, body.prompt, size, frames, fps)
        self.jobs[job.id] = job
        self._tasks[job.id] = asyncio.create_task(self._run(job, prompt, params, ticket))
        return job.to_json()

    def retrieve(self, video_id: str) -> dict[str, Any]:
        return self._job(video_id).to_json()

    def content(self, video_id: str, variant: str) -> FileResponse:
        job = self._job(video_id)
        if variant != "video":
            raise APIError(400, f"variant {variant!r} is not available: only 'video' (the MP4)", param="variant")
        if job.status != "completed":
            raise APIError(409, f"video {video_id} is {job.status}, not completed: it has no content")
        return FileResponse(self.store.path(video_id), media_type="video/mp4", filename=f"{video_id}.mp4")

    def list_videos(self, after: str | None, limit: int, order: str) -> dict[str, Any]:
        self._expire()
        if not 0 <= limit <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit={limit} is invalid: must be in [0, {MAX_LIST_LIMIT}]", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order={order!r} is invalid: 'asc' or 'desc'", param="order")
        jobs = list(self.jobs.values())  # creation order
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise APIError(400, f"after={after!r} is not a video of this server", param="after")
            jobs = jobs[ids.index(after) + 1:]
        page = jobs[:limit]
        return {"object": "list", "data": [j.to_json() for j in page], "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None, "has_more": len(jobs) > len(page)}

    def delete(self, video_id: str) -> dict[str, Any]:
        self._job(video_id)
        self._forget(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    def close(self) -> None:
        """Server shutdown: running jobs are cancelled (their requests aborted), the store removed."""
        for task in self._tasks.values():
            task.cancel()
        if self.store is not None:
            self.store.close()

    # --- a job -----------------------------------------------------------------------------
    async def _run(self, job: VideoJob, prompt: dict[str, Any], params: DiffusionSamplingParams,
                   ticket: Ticket) -> None:
        try:
            job.status = "in_progress"
            video = await self._generate(job, prompt, params)
            path = self.store.path(job.id)
            await asyncio.to_thread(write_mp4, video, path, job.fps)
            for evicted in self.store.add(job.id):
                self.jobs.pop(evicted, None)
            job.complete(self.options.ttl_s)
        except asyncio.CancelledError:
            raise  # deleted, or the server is stopping
        except Exception as e:  # noqa: BLE001 - the job fails with the error a request would get
            err = engine_error(self.ctx, e)
            job.fail(err if isinstance(err, APIError) else APIError(500, str(e)))
            logger.info("video %s failed: %s", job.id, job.error["message"])
        finally:
            ticket.release()
            self._tasks.pop(job.id, None)
        self.ctx.metrics.observe_finished(VIDEOS, time.time() - job.created_at, 0, 0)

    async def _generate(self, job: VideoJob, prompt: dict[str, Any], params: DiffusionSamplingParams) -> torch.Tensor:
        plan: list[Any] = [None] * len(self.ctx.engine.pipeline.stages)
        plan[self.stage.stage_id] = params
        video = None
        async for out in self.ctx.engine.generate(prompt, plan, request_id=job.id, modalities=["video"]):
            video = out.request_output.outputs[0].multimodal_output.get("video")
        if video is None:
            raise APIError(500, "the pipeline ended the request without a video")
        return video[0]

    def _params(self, body: VideoRequest, frames: int, size_multiple: int) -> DiffusionSamplingParams:
        try:
            params = self.stage.new_sampling_params(**body.param_changes(frames))
        except ValueError as e:
            name = next((f for f in DiffusionSamplingParams.__struct_fields__ if f".{f}=" in str(e)), None)
            message = f"size {body.size!r}: {e}" if name in _API_NAME else str(e)
            raise APIError(400, message, param=_API_NAME.get(name, name)) from None
        if params.width and params.height and (params.width % size_multiple or params.height % size_multiple):
            raise APIError(400, f"size {params.width}x{params.height} is invalid for this model: width and height "
                                f"must be multiples of {size_multiple}", param="size")
        limit = self.stage.engine_args.max_generated_image_size or DEFAULT_GENERATED_IMAGE_PIXELS
        if params.height and params.width and params.height * params.width > limit:
            raise APIError(400, f"size {params.width}x{params.height} ({params.width * params.height} pixels) is over "
                                f"this server's limit of {limit} pixels (--max-generated-image-size)", param="size")
        return params

    async def _reference_image(self, body: VideoRequest, upload: bytes | None, image_input: str) -> Any:
        """The input_reference image, fetched and decoded through the media gate, or None. 400: bad
        image, or wrong for this model."""
        source: Any = upload
        if body.input_reference is not None:
            url = body.input_reference.get("image_url")
            if url is None or set(body.input_reference) != {"image_url"}:
                raise APIError(400, "input_reference takes {'image_url': URL or data URL} (file ids are not "
                                    "supported) or an uploaded image file", param="input_reference")
            message = await resolve_media([{"content": [{"type": "image_url", "image_url": url}]}], self.ctx.media)
            source = message[0]["content"][0]["image_url"]["url"]
        elif upload is not None:
            count_upload(len(upload), self.ctx.media)
        if source is None:
            if image_input == "required":
                raise APIError(400, "this model makes videos from an image: give input_reference",
                               param="input_reference")
            return None
        if image_input == "none":
            raise APIError(400, "this model makes videos from text only: it takes no input_reference",
                           param="input_reference")
        try:
            return await asyncio.to_thread(load_image, source, self.ctx.media)
        except MediaError as e:
            raise APIError(400, str(e), param="input_reference") from None

    # --- the job table ---------------------------------------------------------------------
    def _job(self, video_id: str) -> VideoJob:
        self._expire()
        job = self.jobs.get(video_id)
        if job is None:
            raise APIError(404, f"no video {video_id!r} (unknown, deleted or expired)", param="video_id")
        return job

    def _expire(self) -> None:
        now = time.time()
        for video_id in [j.id for j in self.jobs.values() if j.expired(now)]:
            self._forget(video_id)

    def _forget(self, video_id: str) -> None:
        self.jobs.pop(video_id, None)
        task = self._tasks.pop(video_id, None)
        if task is not None:
            task.cancel()  # aborts its request in every stage
        if self.store is not None:
            self.store.remove(video_id)


async def _read_body(raw: Request) -> tuple[VideoRequest, bytes | None]:
    """JSON, or a multipart form whose `input_reference` may be a file (the openai client sends forms)."""
    upload = None
    if raw.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await raw.form()
        fields = {k: v for k, v in form.multi_items() if k != "input_reference" or isinstance(v, str)}
        file = form.get("input_reference")
        if file is not None and not isinstance(file, str):
            upload = await file.read()
            if not upload:
                raise APIError(400, "the input_reference file is empty", param="input_reference")
        if isinstance(fields.get("input_reference"), str):
            raise APIError(400, "input_reference must be an uploaded image file in a form", param="input_reference")
    else:
        try:
            fields = await raw.json()
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(fields, dict):
            raise APIError(400, "the body must be a JSON object")
    try:
        return VideoRequest.model_validate(fields), upload
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        reason = "unsupported parameter" if err.get("type") == "extra_forbidden" else err.get("msg")
        raise APIError(400, f"{where}: {reason}", param=where) from None


def add_video_routes(app: Any, service: VideoService) -> None:
    """The five /v1/videos routes; the store goes when the app shuts down."""
    from fastapi import Query

    @app.post(VIDEOS)
    async def create_video(raw: Request) -> Any:  # JSON or multipart: parsed by the service
        return await service.create(raw)

    @app.get(VIDEOS)
    async def list_videos(after: str | None = None, limit: int = Query(20), order: str = "desc") -> Any:
        return service.list_videos(after, limit, order)

    @app.get(VIDEOS + "/{video_id}")
    async def retrieve_video(video_id: str) -> Any:
        return service.retrieve(video_id)

    @app.get(VIDEOS + "/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> Any:
        return service.content(video_id, variant)

    @app.delete(VIDEOS + "/{video_id}")
    async def delete_video(video_id: str) -> Any:
        return service.delete(video_id)

    app.router.on_shutdown.append(service.close)
