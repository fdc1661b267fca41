"""One Qwen-Image denoiser forward (a CFG step of one request) under each attention kernel and
compile setting: where a diffusion step's time goes, and what each setting buys. A variant is
BACKEND[+compile|+compile_static] (diffusion_attention_backend; compile as enforce_eager false,
with diffusion_compile_dynamic true or false).

    python benchmarks/bench_diffusion_step.py            # H200: the real architecture, random bf16 weights, 1024^2
    python benchmarks/bench_diffusion_step.py --tiny     # CPU smoke run

Two batches: "cfg" is a request's conditional and unconditional rows in one forward (prompt and
negative prompt differ in length, so the text part is padded and attention gets a mask, as in
serving); "equal" is two rows with the same prompt (no mask). Each variant prints ms per
forward (median of --iters after warm-up, compile included in the warm-up) and the max abs
difference of its output from the eager TORCH_SDPA one. --profile prints the top GPU kernels of
the named variants.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch

from bench_diffusion import NEGATIVE, PROMPTS, load  # benchmarks/ (the script's folder)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="TORCH_SDPA,CUDNN_ATTN+compile,CUDNN_ATTN+compile_static")
    p.add_argument("--profile", default="", help="comma-separated variants to profile (their top GPU kernels)")
    p.add_argument("--json", default="bench_diffusion_step.json")
    return p.parse_args()


def batches(model: Any, size: int) -> dict[str, Any]:
    from vllm_omni.model_executor.models.diffusion_model import RowGroup
    from vllm_omni.sampling_params import DiffusionSamplingParams
    from vllm_omni.stage_io import StageRequest

    params = DiffusionSamplingParams(height=size, width=size, num_inference_steps=50, true_cfg_scale=4.0, seed=0)
    req = StageRequest(request_id="0", prompt_token_ids=[], prompt=PROMPTS[0], sampling_params=params,
                       additional_information={"negative_prompt": NEGATIVE})
    p = model.prepare(req, params)
    t = p.timesteps[10]
    cfg = model.make_batch([RowGroup(p, p.latents, t, False), RowGroup(p, p.latents, t, True)])
    equal = model.make_batch([RowGroup(p, p.latents, t, False), RowGroup(p, p.latents, t, False)])
    return {"cfg": cfg, "equal": equal}


def main() -> None:
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.diffusion.denoise import run_denoiser
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    args = parse_args()
    size = args.size or (64 if args.tiny else 1024)
    components, device = load(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[dict[str, Any]] = []
    reference: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for variant in args.variants.split(","):
            backend, _, compile_mode = variant.partition("+")
            accel = DenoiserAcceleration(attention_backend=backend, compile=bool(compile_mode),
                                         compile_dynamic=compile_mode != "compile_static")
            model = QwenImageModel(components, device=device, acceleration=accel)
            for name, batch in batches(model, size).items():
                row: dict[str, Any] = {"variant": variant, "batch": name, "mask": batch.encoder_mask is not None}
                try:
                    start = time.perf_counter()
                    out = run_denoiser(model, batch)
                    sync()
                    row["first_call_s"] = time.perf_counter() - start
                    for _ in range(2):
                        run_denoiser(model, batch)
                    times = []
                    for _ in range(args.iters):
                        sync()
                        t0 = time.perf_counter()
                        out = run_denoiser(model, batch)
                        sync()
                        times.append((time.perf_counter() - t0) * 1000)
                    row["ms"] = statistics.median(times)
                    ref = reference.setdefault(name, out.float())
                    row["max_abs_vs_first"] = (out.float() - ref).abs().max().item()
                    if variant in args.profile.split(",") and name == "cfg":
                        _profile(model, batch, run_denoiser)
                except Exception as e:  # noqa: BLE001 - a variant this machine cannot run is a result too
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump({"size": size, "device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=2)


def _profile(model: Any, batch: Any, run: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(model, batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
