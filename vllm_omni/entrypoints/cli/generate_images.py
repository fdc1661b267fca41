"""`vllm-omni generate MODEL --prompt ... -o out.png`: images (or videos) from a diffusion pipeline, offline.

Every --prompt is one request (with --image, an edit of that image, or a video's first frame);
the images go to --output (default: <output-dir>/image.png), the k-th after the first to
NAME_k.png. A video model (Wan2.2) writes MP4 files (default <output-dir>/video.mp4) at --fps
(default: the model's frame rate).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_omni.config import WorkerType
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.multimodal.diffusion_prompt import to_pil_image
from vllm_omni.multimodal.video_output import DEFAULT_FPS, write_mp4

_PARAMS = {"height": "height", "width": "width", "num_inference_steps": "num_inference_steps",
           "true_cfg_scale": "true_cfg_scale", "guidance_scale": "guidance_scale", "seed": "seed",
           "num_images_per_prompt": "num_outputs_per_prompt", "num_frames": "num_frames",
           "guidance_scale_2": "guidance_scale_2"}


def generate_images(omni: Omni, args: argparse.Namespace) -> int:
    if not args.prompt:
        raise SystemExit("a diffusion model needs --prompt")
    if len(args.image) > 1:
        raise SystemExit("give at most one --image (the image to edit)")
    stage = next(s for s in omni.pipeline.stages if s.worker_type == WorkerType.DIFFUSION)
    changes = {field: getattr(args, flag) for flag, field in _PARAMS.items() if getattr(args, flag) is not None}
    try:
        params = stage.new_sampling_params(**changes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    plan: list[Any] = [None] * len(omni.pipeline.stages)
    plan[stage.stage_id] = params
    prompts = [_prompt(text, args) for text in args.prompt]
    kind = "video" if "video" in omni.output_modalities else "image"
    outputs = omni.generate(prompts, plan, use_tqdm=False, modalities=[kind])
    default = "video.mp4" if kind == "video" else "image.png"
    target = Path(args.output) if args.output else Path(args.output_dir) / default
    fps = args.fps or omni.stage_info(stage.stage_id).get("fps", DEFAULT_FPS)
    written = 0
    for index, out in enumerate(outputs):
        if out.error is not None:
            print(f"[{index}] error: {out.error}")
            continue
        for item in out.request_output.outputs[0].multimodal_output[kind]:
            suffix = target.suffix or Path(default).suffix
            path = target if written == 0 else target.with_name(f"{target.stem}_{written}{suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "video":
                write_mp4(item, path, fps)
                print(f"[{index}] video: {path.resolve()} ({item.shape[3]}x{item.shape[2]}, {item.shape[0]} frames "
                      f"at {fps:g} fps)")
            else:
                to_pil_image(item).save(path)
                print(f"[{index}] image: {path.resolve()} ({item.shape[2]}x{item.shape[1]})")
            written += 1
    return 1 if any(o.error is not None for o in outputs) else 0


def _prompt(text: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt": text}
    if args.negative_prompt is not None:
        prompt["negative_prompt"] = args.negative_prompt
    if args.image:
        prompt["multi_modal_data"] = {"image": args.image[0]}
    return prompt
