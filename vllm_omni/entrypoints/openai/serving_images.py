"""POST /v1/images/generations and POST /v1/images/edits (OpenAI's Images API) on a diffusion stage.

    client.images.generate(model=..., prompt="a fox", size="1024x1024", n=2,
                           extra_body={"negative_prompt": "blurry", "num_inference_steps": 30, "seed": 7})
    client.images.edit(model=..., image=open("in.png", "rb"), prompt="make it snow")

OpenAI's fields: prompt, model, n, size ("WIDTHxHEIGHT" or "auto"), response_format (only
"b64_json": there is no file store to serve URLs from), output_format (png, jpeg, webp), user
(accepted, unused). vLLM-Omni's extensions: negative_prompt, num_inference_steps,
guidance_scale, true_cfg_scale, seed. An unknown field is a 400; so is a bad size, step count
or image, a size over --max-generated-image-size (unset: 2 megapixels), and an edit without
exactly one image. A prompt or negative prompt over
--max-diffusion-prompt-chars is a 413, before anything tokenizes it. The edit image is one
media item under the server's media policy: its bytes, and its pixels read from its header
before it is decoded (--max-image-pixels).
The n images of one request are denoised together (one request of n rows in the stage).
"""
from __future__ import annotations

import base64
import io
import re
import time
import uuid
from typing import Any, Literal

import torch
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_omni.config.stage_config import WorkerType
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.input_limits import DEFAULT_GENERATED_IMAGE_PIXELS
from vllm_omni.entrypoints.openai.media_fetch import count_upload
from vllm_omni.entrypoints.openai.serving_base import ServingContext, as_api_error, race_disconnect, response_metrics
from vllm_omni.multimodal.diffusion_prompt import to_pil_image
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import DiffusionSamplingParams

GENERATIONS, EDITS = "/v1/images/generations", "/v1/images/edits"
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
# DiffusionSamplingParams field -> the API parameter a client sets it with.
_API_NAME = {"height": "size", "width": "size", "num_outputs_per_prompt": "n"}


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str = "auto"
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    user: str | None = None  # OpenAI's end-user id: accepted for compatibility, not used
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None

    def param_changes(self) -> dict[str, Any]:
        changes: dict[str, Any] = {"num_outputs_per_prompt": self.n}
        if self.size != "auto":
            match = _SIZE.match(self.size)
            if match is None:
                raise APIError(400, f"size {self.size!r} is invalid: use 'WIDTHxHEIGHT' (e.g. '1024x1024') or "
                                    "'auto'", param="size")
            changes["width"], changes["height"] = int(match[1]), int(match[2])
        for name in ("num_inference_steps", "guidance_scale", "true_cfg_scale", "seed"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return changes


class ImageService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        stages = [s for s in ctx.engine.pipeline.stages if s.worker_type == WorkerType.DIFFUSION]
        self.stage = stages[0] if stages else None
        self.num_stages = len(ctx.engine.pipeline.stages)

    async def generate(self, body: ImageRequest, raw: Request) -> dict[str, Any]:
        return await self._run(GENERATIONS, body, None, raw)

    async def edit(self, raw: Request) -> dict[str, Any]:
        body, image = await _read_edit_form(raw)
        count_upload(len(image), self.ctx.media)
        return await self._run(EDITS, body, image, raw)

    async def _run(self, endpoint: str, body: ImageRequest, image: bytes | None, raw: Request) -> dict[str, Any]:
        ctx = self.ctx
        arrived = time.monotonic()
        ctx.check_model(body.model)
        if self.stage is None or "image" not in ctx.shape.final_types:
            raise APIError(400, f"this model produces {ctx.shape.modalities()}, not images")
        self._check_prompt_sizes(body)
        params = self._params(body)
        prompt: dict[str, Any] = {"prompt": body.prompt}
        if body.negative_prompt is not None:
            prompt["negative_prompt"] = body.negative_prompt
        if image is not None:
            prompt["multi_modal_data"] = {"image": image}
        plan = [None] * self.num_stages
        plan[self.stage.stage_id] = params
        ctx.check_stages_up(ctx.shape.needed_stages(["image"]))
        ticket = await race_disconnect(raw, ctx.gate.admit())
        try:
            out = await race_disconnect(raw, self._collect(prompt, plan))
        except BaseException as e:
            raise _client_error(e) or as_api_error(ctx, e)  # noqa: B904 - chained inside as_api_error
        finally:
            ticket.release()
        images = out.request_output.outputs[0].multimodal_output["image"]
        ctx.metrics.observe_finished(endpoint, time.monotonic() - arrived, 0, 0, out.stage_durations)
        return {"created": int(time.time()),
                "data": [{"b64_json": _encode(img, body.output_format), "revised_prompt": None} for img in images],
                **response_metrics(out.stage_durations)}

    def _check_prompt_sizes(self, body: ImageRequest) -> None:
        """A text encoder reads a bounded number of tokens: a prompt far longer is refused before
        it costs a tokenizer (in the stage, where other requests wait) any time."""
        most = self.ctx.max_diffusion_prompt_chars
        for name in ("prompt", "negative_prompt"):
            text = getattr(body, name)
            if text is not None and len(text) > most:
                raise APIError(413, f"the {name} has {len(text)} characters, over this server's limit of {most} "
                                    "(--max-diffusion-prompt-chars)", param=name)

    def _params(self, body: ImageRequest) -> DiffusionSamplingParams:
        try:
            params = self.stage.new_sampling_params(**body.param_changes())
        except ValueError as e:
            field = next((f for f in DiffusionSamplingParams.__struct_fields__ if f".{f}=" in str(e)), None)
            raise APIError(400, str(e), param=_API_NAME.get(field, field)) from None
        limit = self.stage.engine_args.max_generated_image_size or DEFAULT_GENERATED_IMAGE_PIXELS
        if params.height and params.width and params.height * params.width > limit:
            raise APIError(400, f"size {params.width}x{params.height} ({params.width * params.height} pixels) is over "
                                f"this server's limit of {limit} pixels (--max-generated-image-size)", param="size")
        return params

    async def _collect(self, prompt: dict[str, Any], plan: list[Any]) -> OmniRequestOutput:
        """The request's image output (its multimodal_output holds "image": [n, 3, H, W])."""
        request_id = f"img-{uuid.uuid4().hex}"
        last = None
        async for out in self.ctx.engine.generate(prompt, plan, request_id=request_id, modalities=["image"]):
            last = out
        if last is None or last.request_output.outputs[0].multimodal_output.get("image") is None:
            raise APIError(500, "the pipeline ended the request without an image")
        return last


async def _read_edit_form(raw: Request) -> tuple[ImageRequest, bytes]:
    """The multipart body of an edit: `image` (or `image[]`) files plus the generation fields."""
    try:
        form = await raw.form()
    except AssertionError as e:  # starlette's way of saying python-multipart is missing
        raise APIError(500, f"multipart forms need the python-multipart package: {e}") from None
    files = [v for k in ("image", "image[]") for v in form.getlist(k)]
    if len(files) != 1 or isinstance(files[0], str):
        raise APIError(400, f"an edit takes exactly one image file, got {len(files)}", param="image")
    if "mask" in form:
        raise APIError(400, "masks are not supported: the model edits the whole image", param="mask")
    fields = {k: v for k, v in form.multi_items() if k not in ("image", "image[]")}
    try:
        body = ImageRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        reason = "unsupported parameter" if err.get("type") == "extra_forbidden" else err.get("msg")
        raise APIError(400, f"{where}: {reason}", param=where) from None
    data = await files[0].read()
    if not data:
        raise APIError(400, "the image file is empty", param="image")
    return body, data


def _encode(image: torch.Tensor, fmt: str) -> str:
    """[3, H, W] floats in [0, 1] -> base64 of the encoded file."""
    buf = io.BytesIO()
    to_pil_image(image).save(buf, format=_FORMATS[fmt])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _client_error(exc: BaseException) -> APIError | None:
    """Failures that are the client's, found past the edge: an edit whose size (derived from its
    image) is over the limit, an edit prompt too long for the model's positions, an image that
    cannot be decoded, an image for a model that takes none (or none for an edit model). They
    name the parameter."""
    message = str(exc)
    if "max_generated_image_size" in message:
        return APIError(400, message, param="size")
    if "text-encoder tokens" in message:
        return APIError(400, message, param="prompt")
    if any(m in message for m in ("cannot decode image", "image must be", "takes no input image", "edits an image",
                                  "--max-image-pixels")):
        return APIError(400, message, param="image")
    return None
