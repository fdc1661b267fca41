"""Qwen-Image text to image: seconds per image on our diffusion engine vs diffusers' pipeline.

    python benchmarks/bench_diffusion.py                 # H200: the real architecture, random bf16 weights,
                                                         # 1024 x 1024, 50 steps, batch 1 and 4, +- TeaCache
    python benchmarks/bench_diffusion.py --tiny          # CPU smoke: the tiny checkpoint, 64 x 64, 4 steps

Both sides share the same component objects (one copy of the weights): diffusers'
QwenImagePipeline is built from them, our QwenImageModel too. Every request uses classifier-free
guidance (true_cfg_scale 4 with a negative prompt, Qwen-Image's usual setting). Batch B: B
different prompts; diffusers gets them as one call with lists of prompts (its batching), our
engine as B requests that share every step. "ours + TeaCache" runs TeaCache (rel_l1_thresh
0.2, the Qwen-Image coefficients); diffusers has no TeaCache for Qwen-Image, so its time is
the no-cache one. One warm-up run per configuration before timing. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["a red fox in the snow, photograph", "a lighthouse on a cliff at night, oil painting",
           "two apples on a wooden table", "a city street in the rain, neon signs, cinematic"]
WARMUP_STEPS = 3  # a 50-step warm-up at batch 4 would cost minutes and warms nothing more
NEGATIVE = " "  # Qwen-Image's documented negative prompt: guidance on, nothing to avoid
# The Qwen-Image text encoder is Qwen2.5-VL-7B-Instruct (text_encoder/config.json of Qwen/Qwen-Image).
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU (a smoke run)")
    p.add_argument("--size", type=int, default=None, help="image height = width (default 1024; tiny: 64)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 50; tiny: 4)")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--tea-cache-thresh", type=float, default=0.2)
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--eager", action="store_true", help="no torch.compile of our transformer blocks (enforce_eager)")
    p.add_argument("--json", default="bench_diffusion.json")
    return p.parse_args(argv)


def real_architecture_folder() -> Path:
    """A diffusers folder with Qwen-Image's component configs and no weights (load_format dummy).
    The tokenizer is the tiny one: prompt encoding runs once per request and its token ids only
    need to exist in the real vocabulary."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from vllm_omni.testing.tiny_qwen_image import QWEN_IMAGE_SCHEDULER
    from vllm_omni.testing.tokenizer import QWEN3_OMNI_MM_TOKENS, make_tiny_tokenizer

    root = Path(tempfile.mkdtemp(prefix="qwen-image-arch-"))
    # The class defaults of both diffusers models are Qwen-Image's released configs.
    for name, cls in (("transformer", QwenImageTransformer2DModel), ("vae", AutoencoderKLQwenImage)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(_default_config(cls)))
    (root / "text_encoder").mkdir()
    (root / "text_encoder" / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", **QWEN_IMAGE_SCHEDULER}))
    make_tiny_tokenizer(QWEN3_OMNI_MM_TOKENS).save_pretrained(root / "tokenizer")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "QwenImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"]}))
    return root


def _default_config(cls: type) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    config = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
    return {"_class_name": cls.__name__, **{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}


def load(args: argparse.Namespace) -> tuple[Any, torch.device]:
    from vllm_omni.model_executor.models.qwen_image.components import load_components

    if args.tiny:
        from vllm_omni.testing import make_tiny_model

        folder = make_tiny_model("qwen_image", Path(tempfile.mkdtemp()) / "tiny", seed=0)
        return load_components(folder, device=torch.device("cpu"), dtype=torch.float32), torch.device("cpu")
    device = torch.device("cuda")
    torch.manual_seed(0)
    return load_components(real_architecture_folder(), device=device, dtype=torch.bfloat16, dummy=True), device


def run_ours(model: Any, prompts: list[str], size: int, steps: int, cache: Any) -> None:
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.sampling_params import DiffusionSamplingParams
    from vllm_omni.stage_io import StageRequest

    engine = DiffusionEngine(model, stage_id=0, max_batch_size=len(prompts), cache=cache)
    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=steps, true_cfg_scale=4.0, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(StageRequest(request_id=str(i), prompt_token_ids=[], prompt=prompt, sampling_params=params,
                                        additional_information={"negative_prompt": NEGATIVE}))
    done = 0
    while engine.has_work():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
            done += 1
    assert done == len(prompts)


def run_diffusers(pipe: Any, prompts: list[str], size: int, steps: int) -> None:
    pipe(prompt=prompts, negative_prompt=[NEGATIVE] * len(prompts), true_cfg_scale=4.0, height=size, width=size,
         num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt")


def timed(fn: Any, device: torch.device, steps: int) -> float:
    """Seconds of fn(steps), after a warm-up fn(WARMUP_STEPS) (kernels, allocator, caches: the
    shapes are the same whatever the step count)."""
    fn(min(steps, WARMUP_STEPS))
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    args = parse_args(argv)
    size = args.size or (64 if args.tiny else 1024)
    steps = args.steps or (4 if args.tiny else 50)
    components, device = load(args)
    # Ours as a stage runs it by default: its blocks compiled unless enforce_eager (CUDA only).
    model = QwenImageModel(components, device=device, acceleration=DenoiserAcceleration(compile=not args.eager))
    pipe = QwenImagePipeline(transformer=components.transformer, vae=components.vae,
                             text_encoder=components.text_encoder, tokenizer=components.tokenizer,
                             scheduler=FlowMatchEulerDiscreteScheduler.from_config(components.scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    rows = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
            row: dict[str, Any] = {"batch": batch}
            row["ours_s_per_image"] = timed(lambda n: run_ours(model, prompts, size, n, None), device, steps) / batch
            cache = TeaCache(TeaCacheConfig(rel_l1_thresh=args.tea_cache_thresh))
            row["ours_tea_cache_s_per_image"] = timed(lambda n: run_ours(model, prompts, size, n, cache),
                                                      device, steps) / batch
            row["tea_cache_skipped_fraction"] = cache.skipped / max(1, cache.computed + cache.skipped)
            if not args.skip_diffusers:
                row["diffusers_s_per_image"] = timed(lambda n: run_diffusers(pipe, prompts, size, n), device,
                                                     steps) / batch
                row["speedup"] = row["diffusers_s_per_image"] / row["ours_s_per_image"]
                row["speedup_tea_cache"] = row["diffusers_s_per_image"] / row["ours_tea_cache_s_per_image"]
            rows.append(row)
            print(json.dumps(row), flush=True)  # a run cut short still leaves its finished rows
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": "tiny qwen_image" if args.tiny else "Qwen-Image architecture, random bf16 weights",
              "size": size, "steps": steps, "true_cfg_scale": 4.0, "tea_cache_thresh": args.tea_cache_thresh,
              "torch": torch.__version__, "rows": rows}
    _print(result)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"{result['model']} on {result['device']}: {result['size']}x{result['size']}, {result['steps']} steps, CFG")
    print("| batch | diffusers s/img | ours s/img | ours + TeaCache s/img | speedup | speedup + TeaCache | skipped |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        d = r.get("diffusers_s_per_image")
        print(f"| {r['batch']} | {d:.3f} | " if d is not None else f"| {r['batch']} | - | ", end="")
        print(f"{r['ours_s_per_image']:.3f} | {r['ours_tea_cache_s_per_image']:.3f} | "
              f"{r.get('speedup', float('nan')):.2f}x | {r.get('speedup_tea_cache', float('nan')):.2f}x | "
              f"{r['tea_cache_skipped_fraction']:.0%} |")


if __name__ == "__main__":
    main()
