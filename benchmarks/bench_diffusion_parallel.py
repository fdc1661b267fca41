"""Qwen-Image on several GPUs: seconds per denoising step and the image against one GPU's.

    python benchmarks/bench_diffusion_parallel.py --ulysses 2              # 2 GPUs, Ulysses
    python benchmarks/bench_diffusion_parallel.py --ring 2                 # 2 GPUs, ring attention
    python benchmarks/bench_diffusion_parallel.py --ulysses 2 --ring 2     # 4 GPUs, USP (Ulysses inside, ring across)
    python benchmarks/bench_diffusion_parallel.py --cfg-parallel 2 --ulysses 4 --use-hsdp --vae-patch 4  # 8 GPUs
    python benchmarks/bench_diffusion_parallel.py --tiny --ulysses 2 --ulysses-mode advanced_uaa  # CPU smoke (gloo)

The model is the real Qwen-Image architecture with random bf16 weights (the same seed on every
rank and in the one-GPU run: the images are comparable), or with --tiny the tiny checkpoint on
the CPU. The stage's own process group starts the ranks (DiffusionProcessGroup, as a served
stage does: no torchrun), one per GPU of this machine. First the one-GPU baseline (skip it with
--no-baseline), then the parallel world, each with one warm-up request (compilation) and one
timed request: one prompt, classifier-free guidance on (true_cfg_scale 4), the same seed.
Reported: the median seconds of a denoising step, seconds per image (with the VAE decode), the
speed-up, the largest pixel difference and the PSNR of the parallel image against the
baseline's. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

QWEN_IMAGE = "vllm_omni.model_executor.models.qwen_image.model:QwenImageModel"
PROMPT, NEGATIVE = "a lighthouse on a cliff at night, oil painting", " "
WARMUP_STEPS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ulysses", type=int, default=1, help="ulysses_degree")
    p.add_argument("--ring", type=int, default=1, help="ring_degree")
    p.add_argument("--ulysses-mode", choices=("strict", "advanced_uaa"), default="strict")
    p.add_argument("--cfg-parallel", type=int, choices=(1, 2), default=1, help="cfg_parallel_size")
    p.add_argument("--use-hsdp", action="store_true")
    p.add_argument("--hsdp-shard-size", type=int, default=-1)
    p.add_argument("--hsdp-replicate-size", type=int, default=1)
    p.add_argument("--vae-patch", type=int, default=1, help="vae_patch_parallel_size")
    p.add_argument("--size", type=int, default=None, help="image height = width (default 1024; tiny: 64)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 20; tiny: 3)")
    p.add_argument("--eager", action="store_true", help="no torch.compile of the transformer blocks")
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU, gloo (a smoke run)")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-GPU run (no image difference)")
    p.add_argument("--json", default="bench_diffusion_parallel.json")
    return p.parse_args(argv)


def layout_of(args: argparse.Namespace) -> Any:
    from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig

    return DiffusionParallelConfig(cfg_parallel_size=args.cfg_parallel, ulysses_degree=args.ulysses,
                                   ring_degree=args.ring, ulysses_mode=args.ulysses_mode, use_hsdp=args.use_hsdp,
                                   hsdp_shard_size=args.hsdp_shard_size, hsdp_replicate_size=args.hsdp_replicate_size,
                                   vae_patch_parallel_size=args.vae_patch).check()


def model_spec(args: argparse.Namespace) -> tuple[Any, torch.device]:
    from vllm_omni.diffusion.process_group import ModelSpec
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration

    acceleration = DenoiserAcceleration(compile=not args.eager)
    if args.tiny:
        from vllm_omni.testing import make_tiny_model

        folder = make_tiny_model("qwen_image", Path(tempfile.mkdtemp()) / "tiny", seed=0)
        return ModelSpec(QWEN_IMAGE, str(folder), "float32", acceleration=acceleration), torch.device("cpu")
    folder = _bench_diffusion().real_architecture_folder()
    return ModelSpec(QWEN_IMAGE, str(folder), "bfloat16", dummy=True, seed=0, acceleration=acceleration), \
        torch.device("cuda")


def _bench_diffusion() -> Any:
    """benchmarks/bench_diffusion.py (the real architecture's folder), a sibling file."""
    spec = importlib.util.spec_from_file_location("bench_diffusion", Path(__file__).with_name("bench_diffusion.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(engine: Any, size: int, steps: int, device: torch.device) -> tuple[list[float], float, torch.Tensor]:
    """One request: the seconds of each engine step (the last one decodes), the total, the image."""
    from vllm_omni.sampling_params import DiffusionSamplingParams
    from vllm_omni.stage_io import StageRequest

    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=steps, true_cfg_scale=4.0, seed=0)
    engine.add_request(StageRequest(request_id=f"r{time.monotonic_ns()}", prompt_token_ids=[], prompt=PROMPT,
                                    sampling_params=params, additional_information={"negative_prompt": NEGATIVE}))
    times, image = [], None
    start = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
            image = out.multimodal_output["image"]
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, time.perf_counter() - start, image


def measure(engine: Any, size: int, steps: int, device: torch.device) -> dict[str, Any]:
    generate(engine, size, WARMUP_STEPS, device)  # compilation, allocator, communicators
    times, total, image = generate(engine, size, steps, device)
    # The first step also prepares the request (prompt encoding), the last decodes: the steps between.
    denoise = times[1:-1] or times
    return {"step_s": statistics.median(denoise), "image_s": total, "image": image}


def run_baseline(spec: Any, device: torch.device, size: int, steps: int) -> dict[str, Any]:
    from vllm_omni.diffusion.engine import DiffusionEngine

    engine = DiffusionEngine(spec.build(device), stage_id=0, max_batch_size=1)
    with torch.inference_mode():
        result = measure(engine, size, steps, device)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_parallel(spec: Any, device: torch.device, layout: Any, size: int, steps: int) -> dict[str, Any]:
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.diffusion.process_group import DiffusionProcessGroup

    group = DiffusionProcessGroup.start(spec, None, device, layout)
    try:
        model = spec.build(device, group.join())
        group.wait_loaded()
        engine = DiffusionEngine(model, stage_id=0, max_batch_size=1, group=group)
        with torch.inference_mode():
            result = measure(engine, size, steps, device)
        if device.type == "cuda":
            result["rank0_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        return result
    finally:
        group.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    layout = layout_of(args)
    size = args.size or (64 if args.tiny else 1024)
    steps = args.steps or (3 if args.tiny else 20)
    spec, device = model_spec(args)
    if device.type == "cuda" and torch.cuda.device_count() < layout.world_size:
        raise SystemExit(f"{layout.describe_world()} needs {layout.world_size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "model": "tiny qwen_image" if args.tiny else "Qwen-Image architecture, random bf16",
                              "size": size, "steps": steps, "compiled": not args.eager and device.type == "cuda",
                              "parallel": layout.describe(), "torch": torch.__version__}
    baseline = None if args.no_baseline else run_baseline(spec, device, size, steps)
    parallel = run_parallel(spec, device, layout, size, steps)
    result.update(parallel_step_s=parallel["step_s"], parallel_image_s=parallel["image_s"])
    if "rank0_peak_gib" in parallel:
        result["rank0_peak_gib"] = parallel["rank0_peak_gib"]
    if baseline is not None:
        diff = (parallel["image"] - baseline["image"]).abs()
        mse = float((diff ** 2).mean())
        result.update(baseline_step_s=baseline["step_s"], baseline_image_s=baseline["image_s"],
                      step_speedup=baseline["step_s"] / parallel["step_s"],
                      image_speedup=baseline["image_s"] / parallel["image_s"],
                      max_abs_pixel_diff=float(diff.max()), psnr_db=10 * math.log10(1 / mse) if mse else math.inf)
    _print(result)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _print(r: dict[str, Any]) -> None:
    print(f"{r['model']} on {r['device']}: {r['size']}x{r['size']}, {r['steps']} steps, CFG, "
          f"compiled={r['compiled']}, {json.dumps(r['parallel'])}")
    print("| run | s/step | s/image | step speed-up | max pixel diff | PSNR |")
    print("| --- | --- | --- | --- | --- | --- |")
    if "baseline_step_s" in r:
        print(f"| 1 rank | {r['baseline_step_s']:.3f} | {r['baseline_image_s']:.2f} | 1.00x | - | - |")
        print(f"| {r['parallel']['world_size']} ranks | {r['parallel_step_s']:.3f} | {r['parallel_image_s']:.2f} | "
              f"{r['step_speedup']:.2f}x | {r['max_abs_pixel_diff']:.2e} | {r['psnr_db']:.1f} dB |")
    else:
        print(f"| {r['parallel']['world_size']} ranks | {r['parallel_step_s']:.3f} | {r['parallel_image_s']:.2f} "
              "| - | - | - |")


if __name__ == "__main__":
    main()
