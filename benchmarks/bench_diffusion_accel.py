"""Qwen-Image acceleration on our engine: seconds per image of each variant, and its image against
the uncached bf16 image of the same seed (PSNR, dB; images in [0, 1]).

    python benchmarks/bench_diffusion_accel.py           # H200: the released architecture, random bf16 weights,
                                                         # 1024 x 1024, 50 steps, CFG, compiled blocks
    python benchmarks/bench_diffusion_accel.py --tiny    # CPU smoke: the tiny checkpoint, 64 x 64, 10 steps

Variants, one request each (true_cfg_scale 4 with a negative prompt), in this order (FP8 quantizes
the weights in place, so the bf16 ones run first, on the same weights):

    bf16              the reference
    tea_cache         TeaCache, rel_l1_thresh 0.2 (the Qwen-Image coefficients)
    cache_dit         DBCache with upstream vLLM-Omni's defaults (F1 B0, warm-up 4, threshold 0.24,
                      at most 3 cached steps in a row)
    cache_dit_fixed   DBCache on a fixed schedule (steps_computation_mask, static policy): the first
                      8 steps, then every other step, and the last 2 compute; the others reuse.
                      On random weights a dynamic cache's skip rate says little; this one is fixed.
    fp8               online FP8 weights (per-channel scales, per-token activations, torch._scaled_mm)
    fp8+cache_dit_fixed
    fp8+fp8_kv        FP8 weights and FP8 K/V in attention (quality only: PyTorch has no FP8
                      attention kernel, K and V are multiplied back before cuDNN's)

Each variant runs a 3-step warm-up first (torch.compile of the blocks for its shapes), then the
timed request. Prints JSON rows as they finish and a markdown table for docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench_diffusion import NEGATIVE, PROMPTS, load  # benchmarks/ (the script's folder)

WARMUP_STEPS = 3
VARIANTS = ("bf16", "tea_cache", "cache_dit", "cache_dit_fixed", "fp8", "fp8+cache_dit_fixed", "fp8+fp8_kv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU (a smoke run)")
    p.add_argument("--size", type=int, default=None, help="height = width (default 1024; tiny: 64)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 50; tiny: 10)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--eager", action="store_true", help="no torch.compile of the blocks (enforce_eager)")
    p.add_argument("--json", default="bench_diffusion_accel.json")
    return p.parse_args(argv)


def fixed_schedule(steps: int) -> list[int]:
    """1 = compute: the first 8 steps (at most half), every other step after them, the last 2."""
    head = min(8, steps // 2)
    return [1 if i < head or i >= steps - 2 or (i - head) % 2 == 0 else 0 for i in range(steps)]


def cache_for(variant: str, steps: int) -> Any:
    from vllm_omni.diffusion.db_cache import DBCache, DBCacheConfig
    from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig

    if variant.endswith("tea_cache"):
        return TeaCache(TeaCacheConfig(rel_l1_thresh=0.2))
    if variant.endswith("cache_dit"):
        return DBCache(DBCacheConfig())
    if variant.endswith("cache_dit_fixed"):
        return DBCache(DBCacheConfig(steps_computation_mask=tuple(fixed_schedule(steps)),
                                     steps_computation_policy="static", max_warmup_steps=8))
    return None


def generate(model: Any, size: int, steps: int, cache: Any) -> torch.Tensor:
    """One guided request on a fresh engine; its image [3, H, W]."""
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.sampling_params import DiffusionSamplingParams
    from vllm_omni.stage_io import StageRequest

    engine = DiffusionEngine(model, stage_id=0, max_batch_size=1, cache=cache)
    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=steps, true_cfg_scale=4.0, seed=0)
    engine.add_request(StageRequest(request_id="0", prompt_token_ids=[], prompt=PROMPTS[0], sampling_params=params,
                                    additional_information={"negative_prompt": NEGATIVE}))
    image = None
    while engine.has_work():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
            image = out.multimodal_output["image"][0]
    return image


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.float() - b.float()) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def model_for(variant: str, components: Any, device: torch.device, compile_blocks: bool) -> Any:
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.diffusion_attention_spec import AttentionSettings
    from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    fp8 = DiffusionQuantization("fp8") if variant.startswith("fp8") else None
    kv = AttentionSettings(kv_cache_dtype="fp8") if variant.endswith("fp8_kv") else AttentionSettings()
    return QwenImageModel(components, device=device, acceleration=DenoiserAcceleration(
        compile=compile_blocks, quantization=fp8, attention=kv))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    size, steps = args.size or (64 if args.tiny else 1024), args.steps or (10 if args.tiny else 50)
    components, device = load(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = args.variants.split(",")
    if variants[0] != "bf16" or any(not v.startswith("fp8") for v in variants[next(
            (i for i, v in enumerate(variants) if v.startswith("fp8")), len(variants)):]):
        raise SystemExit("--variants: bf16 first (the reference of every PSNR), the fp8 ones last (they quantize "
                         "the weights in place)")
    # One model per weight / attention setting (the caches belong to the engine): fewer
    # wrappers of the same blocks for torch.compile to guard on, and room for the recompilations.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    models: dict[tuple[bool, bool], Any] = {}
    rows: list[dict[str, Any]] = []
    reference = None
    with torch.inference_mode():
        for variant in variants:
            key = (variant.startswith("fp8"), variant.endswith("fp8_kv"))
            if key not in models:
                models[key] = model_for(variant, components, device, compile_blocks=not args.eager)
            model = models[key]
            generate(model, size, min(steps, WARMUP_STEPS), cache_for(variant, min(steps, WARMUP_STEPS)))
            cache = cache_for(variant, steps)
            sync()
            start = time.perf_counter()
            image = generate(model, size, steps, cache)
            sync()
            row: dict[str, Any] = {"variant": variant, "s_per_image": time.perf_counter() - start}
            reference = image if reference is None else reference
            row["psnr_db_vs_bf16"] = psnr(image, reference)
            if cache is not None:
                row["reused_fraction"] = cache.skipped / max(1, cache.skipped + cache.computed)
            rows.append(row)
            print(json.dumps(row), flush=True)  # a run cut short still leaves its finished rows
    base = rows[0]["s_per_image"]
    for row in rows:
        row["speedup"] = base / row["s_per_image"]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": "tiny qwen_image" if args.tiny else "Qwen-Image architecture, random bf16 weights",
              "size": size, "steps": steps, "compiled": any(m.compiled for m in models.values()),
              "torch": torch.__version__, "rows": rows}
    print_table(result)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']}: {result['size']}x{result['size']}, {result['steps']} steps, "
          f"CFG, one request, blocks {'compiled' if result['compiled'] else 'eager'}")
    print("| variant | s/image | speed-up | row-steps reused | PSNR vs bf16 (dB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        reused = f"{r['reused_fraction']:.0%}" if "reused_fraction" in r else "-"
        quality = "ref" if r is result["rows"][0] else f"{r['psnr_db_vs_bf16']:.1f}"
        print(f"| {r['variant']} | {r['s_per_image']:.2f} | {r['speedup']:.2f}x | {reused} | {quality} |")


if __name__ == "__main__":
    main()
