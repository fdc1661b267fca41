"""`vllm-omni generate MODEL --prompt ... -o out.png`: images from a diffusion pipeline, offline.

Every --prompt is one request (with --image, an edit of that image); the images go to
--output (default: <output-dir>/image.png), the k-th after the first to NAME_k.png.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_omni.config import WorkerType
from vllm_omni.entrypoints.omni import Omni

_PARAMS = {"height": "height", "width": "width", "num_inference_steps": "num_inference_steps",
           "true_cfg_scale": "true_cfg_scale", "guidance_scale": "guidance_scale", "seed": "seed",
           "num_images_per_prompt": "num_outputs_per_prompt"}


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
    outputs = omni.generate(prompts, plan, use_tqdm=False, modalities=["image"])
    target = Path(args.output) if args.output else Path(args.output_dir) / "image.png"
    written = 0
    for index, out in enumerate(outputs):
        if out.error is not None:
            print(f"[{index}] error: {out.error}")
            continue
        for image in out.request_output.outputs[0].multimodal_output["image"]:
            path = target if written == 0 else target.with_name(f"{target.stem}_{written}{target.suffix or '.png'}")
            _save(image, path)
            print(f"[{index}] image: {path.resolve()} ({image.shape[2]}x{image.shape[1]})")
            written += 1
    return 1 if any(o.error is not None for o in outputs) else 0


def _prompt(text: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt": text}
    if args.negative_prompt is not None:
        prompt["negative_prompt"] = args.negative_prompt
    if args.image:
        prompt["multi_modal_data"] = {"image": args.image[0]}
    return prompt


def _save(image: Any, path: Path) -> None:
    from vllm_omni.multimodal.diffusion_prompt import to_pil_image

    path.parent.mkdir(parents=True, exist_ok=True)
    to_pil_image(image).save(path)
