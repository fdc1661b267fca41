"""`--diffusion-load-format diffusers`: any diffusers pipeline as a stage, one whole call per request.

The pipeline is `DiffusionPipeline.from_pretrained(model, **diffusers_load_kwargs)` (or the class
`model_class_name` names). Each request is one pipeline call: `diffusers_call_kwargs`, then the
request's own parameters on top (prompt, negative prompt, input image, size, steps, guidance,
seed, images per prompt); a parameter left at its default does not override a call kwarg, and
parameters the pipeline's `__call__` does not take are not passed. There is no step execution:
requests run one at a time, and an abort only reaches requests that have not started.
Images come back as `{"image": [n, 3, H, W]}`, video frames as `{"video": [n, frames, 3, H, W]}`.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import secrets
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni.config.stage_config import StageEngineArgs
from vllm_omni.diffusion.profiler import CALL, PipelineProfiler, timed
from vllm_omni.model_executor.models import diffusion_inputs
from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageInfo, StageInputChunk, StageOutput, StageRequest, error_output

logger = logging.getLogger(__name__)
_DEFAULTS = DiffusionSamplingParams()


def load_diffusers_pipeline(model_path: str, args: StageEngineArgs, device: torch.device, dtype: torch.dtype) -> Any:
    import diffusers

    if args.enable_layerwise_offload:
        _check_block_offload(args)
    cls = diffusers.DiffusionPipeline
    if args.model_class_name is not None:
        cls = getattr(diffusers, args.model_class_name, None)
        if cls is None:
            raise ValueError(f"model_class_name={args.model_class_name!r} is not a diffusers pipeline class")
    # The user's load kwargs override ours (spec 001), in either spelling of the dtype.
    user = dict(args.diffusers_load_kwargs)
    ours = {} if "torch_dtype" in user else {"dtype": dtype}
    ours.update(auxiliary_text_encoder(model_path, cls, args.auxiliary_text_encoder, dtype))
    pipe = cls.from_pretrained(model_path, **{**ours, **user})
    if args.vae_use_slicing:
        pipe.vae.enable_slicing()
    if args.vae_use_tiling:
        pipe.vae.enable_tiling()
    if args.enable_layerwise_offload:
        _offload_blocks(pipe, device)
    elif args.enable_cpu_offload and device.type != "cpu":
        pipe.enable_model_cpu_offload(device=device)  # diffusers' own offload (needs accelerate)
    else:
        pipe.to(device)
    return pipe


def _check_block_offload(args: StageEngineArgs) -> None:
    """Before loading: what enable_layerwise_offload needs in the adapter."""
    if args.enable_cpu_offload:
        raise ValueError("enable_layerwise_offload and enable_cpu_offload do not combine in the diffusers adapter "
                         "(diffusers offloads a module one way); choose one")
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError("enable_layerwise_offload in the diffusers adapter is diffusers' group offload, which needs "
                         "the accelerate package (pip install accelerate); the native engine needs nothing")


def _offload_blocks(pipe: Any, device: torch.device) -> None:
    """enable_layerwise_offload in the adapter: diffusers' group offload of the denoiser, one block per
    group, the next one prefetched on a side stream (CUDA); the other components go to the device."""
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if denoiser is None or not hasattr(denoiser, "enable_group_offload"):
        raise ValueError(f"enable_layerwise_offload: {type(pipe).__name__} has no transformer or unet that diffusers "
                         "can offload block by block")
    denoiser.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                                  num_blocks_per_group=1, use_stream=device.type == "cuda")
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module) and component is not denoiser:
            component.to(device)


# A pipeline component an auxiliary text encoder fills (upstream's --auxiliary-text-encoder is
# HiDream-I1's Llama-3.1 encoder, which its diffusers folders do not ship).
AUXILIARY_ENCODER, AUXILIARY_TOKENIZER = "text_encoder_4", "tokenizer_4"


def auxiliary_text_encoder(model_path: str, cls: type, name: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """`--auxiliary-text-encoder` (a model name or path) as the pipeline's Llama text encoder and
    tokenizer (diffusers' HiDreamImagePipeline takes them as text_encoder_4 / tokenizer_4, loaded
    as its documentation shows); a pipeline that takes none refuses it."""
    if name is None:
        return {}
    import diffusers

    pipeline = cls
    if cls is diffusers.DiffusionPipeline:  # the folder names its class
        pipeline = getattr(diffusers, diffusers.DiffusionPipeline.load_config(model_path)["_class_name"], cls)
    if AUXILIARY_ENCODER not in inspect.signature(pipeline.__init__).parameters:
        raise ValueError(f"auxiliary_text_encoder {name!r}: {pipeline.__name__} takes no auxiliary text encoder "
                         f"(a pipeline with a {AUXILIARY_ENCODER} component does, e.g. HiDreamImagePipeline)")
    from transformers import AutoTokenizer, LlamaForCausalLM

    encoder = LlamaForCausalLM.from_pretrained(name, output_hidden_states=True, output_attentions=True, dtype=dtype)
    return {AUXILIARY_ENCODER: encoder, AUXILIARY_TOKENIZER: AutoTokenizer.from_pretrained(name)}


class DiffusersPipelineEngine:
    def __init__(self, pipe: Any, *, stage_id: int, device: str, call_kwargs: dict[str, Any] | None = None,
                 max_image_pixels: int | None = None, profile: bool = False) -> None:
        """`profile` (enable_diffusion_pipeline_profiler): finished outputs carry the call's seconds."""
        self.pipe = pipe
        self.stage_id = stage_id
        self.device = device
        self.call_kwargs = dict(call_kwargs or {})
        self.max_image_pixels = max_image_pixels
        self._accepted = set(inspect.signature(pipe.__call__).parameters)
        self._queue: deque[StageRequest] = deque()
        self._ready: list[StageOutput] = []
        self.profiler = PipelineProfiler(type(pipe).__name__, device) if profile else None

    def add_request(self, req: StageRequest) -> None:
        params = req.sampling_params
        if not isinstance(params, DiffusionSamplingParams):
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: a diffusion stage needs "
                                                            f"DiffusionSamplingParams, got {type(params).__name__}"))
            return
        if params.height and params.width and self.max_image_pixels and params.height * params.width > self.max_image_pixels:
            self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: the image size "
                                            f"{params.width}x{params.height} is over max_generated_image_size="
                                            f"{self.max_image_pixels}"))
            return
        self._queue.append(req)

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        self._queue = deque(r for r in self._queue if r.request_id not in ids)

    def step(self) -> list[StageOutput]:
        if self._queue:
            req = self._queue.popleft()
            try:
                with timed(self.profiler, CALL, [req.request_id]):
                    result = self._call(req)
            except Exception as e:  # noqa: BLE001 - the request fails alone
                logger.warning("stage %d: request %s failed: %s", self.stage_id, req.request_id, e)
                self._ready.append(error_output(req.request_id, f"stage {self.stage_id}: {type(e).__name__}: {e}"))
            else:
                durations = self.profiler.pop(req.request_id) if self.profiler is not None else None
                self._ready.append(StageOutput(request_id=req.request_id, finished=True, finish_reason="stop",
                                               multimodal_output=result, stage_durations=durations))
        outputs, self._ready = self._ready, []
        return outputs

    def _call_arguments(self, req: StageRequest) -> dict[str, Any]:
        params: DiffusionSamplingParams = req.sampling_params
        given: dict[str, Any] = {"prompt": diffusion_inputs.prompt_text(req)}
        negative = diffusion_inputs.negative_prompt(req)
        if negative is not None:
            given["negative_prompt"] = negative
        image = diffusion_inputs.input_image(req)
        if image is not None:
            from PIL import Image

            given["image"] = Image.fromarray(image.numpy())
        for name, call_name in (("height", "height"), ("width", "width"), ("num_inference_steps", "num_inference_steps"),
                                ("true_cfg_scale", "true_cfg_scale"), ("guidance_scale", "guidance_scale"),
                                ("num_outputs_per_prompt", "num_images_per_prompt"),
                                ("num_outputs_per_prompt", "num_videos_per_prompt"), ("num_frames", "num_frames"),
                                ("guidance_scale_2", "guidance_scale_2")):
            value = getattr(params, name)
            if value is not None and (value != getattr(_DEFAULTS, name) or call_name not in self.call_kwargs):
                given[call_name] = value
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        given["generator"] = torch.Generator("cpu").manual_seed(seed)
        merged = {**self.call_kwargs, **given, "output_type": "pt", "return_dict": True}
        return {k: v for k, v in merged.items() if k in self._accepted}

    @torch.inference_mode()
    def _call(self, req: StageRequest) -> dict[str, torch.Tensor]:
        out = self.pipe(**self._call_arguments(req))
        if getattr(out, "frames", None) is not None:
            return {"video": torch.as_tensor(out.frames).float().cpu()}
        images = getattr(out, "images", None)
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"{type(self.pipe).__name__} returned no image or frame tensor (got {type(out).__name__})")
        return {"image": images.float().cpu()}

    def add_input(self, chunk: StageInputChunk) -> None:
        # The orchestrator streams only into stages that say they take streamed input.
        self._ready.append(error_output(chunk.request_id, "a diffusion stage takes no streamed input"))

    def pause(self, request_ids: Sequence[str], paused: bool) -> None:
        """Nothing to pause: a diffusion stage feeds no streaming edge."""

    def poll_ms(self) -> None:
        return None  # every step finishes its work on the device

    def has_work(self) -> bool:
        return bool(self._queue or self._ready)

    def fail_all(self, error: str) -> list[StageOutput]:
        return []  # nothing runs between steps; a failed call already reported its request

    def stats(self) -> dict[str, int]:
        return {"num_unfinished": len(self._queue), "num_waiting": len(self._queue), "num_running": 0}

    def describe(self) -> StageInfo:
        return StageInfo(engine="diffusers", device=self.device, details={"pipeline": type(self.pipe).__name__})
