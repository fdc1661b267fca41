"""Wan2.2 video generation: one denoising step and one whole video, ours against diffusers' pipeline.

    python benchmarks/bench_video.py                  # H200: T2V-A14B at 832x480x81 and TI2V-5B at 1280x704x121,
                                                      # random bf16 weights of the released architectures
    python benchmarks/bench_video.py --models a14b    # one model (each fits a 10-minute device call alone)
    python benchmarks/bench_video.py --tiny           # CPU smoke run: the tiny checkpoints

Both sides share the same component objects (one copy of the weights): diffusers' WanPipeline
is built from the components our WanModel loaded. Ours runs as the bundled stage does
(`enforce_eager: false`: compiled blocks, cuDNN attention; `--eager`: diffusers' blocks);
diffusers runs its defaults.

- step: one request's CFG step (prompt and negative prompt, guidance 4) on the high-noise
  expert: ours is one forward of both rows and the guidance combination (what the engine's
  Denoiser does each step), diffusers' is its loop body (two transformer calls, then the
  combination). Median of --iters after --warmup calls (ours compiles in its first), timed with
  CUDA events; the two guided velocities' max difference is printed with it.
- video: one request of --video-steps steps (4: A14B's schedule runs both experts), prompt
  encoding and VAE decoding included: ours through the DiffusionEngine, diffusers' pipeline call.

Prints a markdown table (for docs/benchmarks.md) and writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PROMPT = "A cat and a dog baking a cake together in a kitchen, sunlight streaming through the window"
NEGATIVE = "blurry, low quality, static, overexposed"
# google/umt5-xxl's encoder (text_encoder/config.json of the Wan2.2 diffusers folders).
UMT5_XXL = {"architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 256384, "d_model": 4096,
            "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
            "tie_word_embeddings": False, "dense_act_fn": "gelu_new", "is_gated_act": True}
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12,
             "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "latents_mean": [0.0] * 48,
             "latents_std": [1.0] * 48}


@dataclass(frozen=True)
class Spec:
    """A released model's architecture and the size it is benchmarked at."""

    name: str
    transformer: dict[str, Any]  # WanTransformer3DModel kwargs over diffusers' defaults (Wan 14B's)
    vae: dict[str, Any]  # AutoencoderKLWan kwargs over its defaults (Wan2.1's VAE)
    experts: int
    boundary_ratio: float | None
    expand_timesteps: bool
    flow_shift: float  # the model's sample_shift
    size: tuple[int, int, int]  # width, height, frames
    tiny_layout: str
    tiny_size: tuple[int, int, int]


SPECS = {
    "a14b": Spec("Wan2.2-T2V-A14B", {}, {}, 2, 0.875, False, 12.0, (832, 480, 81), "a14b", (48, 32, 5)),
    "ti2v": Spec("Wan2.2-TI2V-5B", {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
                                    "out_channels": 48}, WAN22_VAE, 1, None, True, 5.0, (1280, 704, 121), "ti2v",
                 (64, 64, 5)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="a14b,ti2v", help="comma-separated: a14b, ti2v")
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoints on the CPU (a smoke run)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--video-steps", type=int, default=4)
    p.add_argument("--skip-video", action="store_true")
    p.add_argument("--eager", action="store_true", help="ours without torch.compile (enforce_eager)")
    p.add_argument("--variants", default="", help="more settings of ours to time one step with, comma-separated "
                   "BACKEND[+compile][+fp8] (e.g. TORCH_SDPA+compile,CUDNN_ATTN+compile+fp8): attention kernel, "
                   "compilation, online FP8 weights (these run last: they quantize the shared weights in place)")
    p.add_argument("--json", default="bench_video.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    rows = []
    for key in args.models.split(","):
        row = bench_model(SPECS[key], args, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
        release_memory(device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "command": "python benchmarks/bench_video.py " + " ".join(argv or []), "rows": rows}
    print(table(result), flush=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def bench_model(spec: Spec, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    width, height, frames = spec.tiny_size if args.tiny else spec.size
    folder = tiny_folder(spec) if args.tiny else architecture_folder(spec)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    started = time.perf_counter()
    model = WanModel.load(folder, device=device, dtype=dtype, dummy=not args.tiny,
                          acceleration=DenoiserAcceleration(compile=not args.eager))
    pipe = diffusers_pipeline(model)
    row: dict[str, Any] = {"model": spec.name, "size": f"{width}x{height}x{frames}", "dtype": str(dtype)[6:],
                           "compiled": model.compiled, "load_s": round(time.perf_counter() - started, 1)}
    params = dict(height=height, width=width, num_frames=frames, guidance_scale=4.0, seed=0,
                  **({"guidance_scale_2": 3.0} if spec.experts == 2 else {}))
    request = started_request(model, params, steps=50)
    with torch.inference_mode():
        ours_step, theirs_step = ours_step_fn(model, request), diffusers_step_fn(model, request)
        row["ours_first_call_s"] = round(timed(ours_step, device, 1)[0] / 1000, 1)  # compiles on CUDA
        for name, fn in (("diffusers", theirs_step), ("ours", ours_step)):
            times = timed(fn, device, args.warmup + args.iters)[args.warmup:]
            row[f"{name}_ms_per_step"] = round(statistics.median(times), 1)
        row["step_speedup"] = round(row["diffusers_ms_per_step"] / row["ours_ms_per_step"], 3)
        reference = ours_step().float()
        row["step_max_abs_diff"] = (reference - theirs_step().float()).abs().max().item()
    variants = [v for v in args.variants.split(",") if v]
    fp8_last = sorted(variants, key=lambda v: "fp8" in v.split("+"))  # (a stable sort)
    for variant in [v for v in fp8_last if "fp8" not in v.split("+")]:
        row.update(time_variant(variant, model, request, reference, args, device))
    if not args.skip_video:
        row.update(bench_video(model, pipe, params, args.video_steps, device))
    for variant in [v for v in fp8_last if "fp8" in v.split("+")]:
        row.update(time_variant(variant, model, request, reference, args, device))
    return row


def time_variant(variant: str, model: Any, request: Any, reference: torch.Tensor, args: argparse.Namespace,
                 device: torch.device) -> dict[str, Any]:
    """One step of ours with other settings on the same components: ms and the velocity's max
    difference from the default setting's."""
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    backend, *options = variant.split("+")
    if set(options) - {"compile", "fp8"}:
        raise SystemExit(f"--variants {variant!r}: BACKEND[+compile][+fp8]")
    acceleration = DenoiserAcceleration(attention_backend=backend or None, compile="compile" in options,
                                        quantization=DiffusionQuantization("fp8") if "fp8" in options else None)
    with torch.inference_mode():
        step = ours_step_fn(WanModel(model.c, device=device, acceleration=acceleration), request)
        times = timed(step, device, args.warmup + args.iters)[args.warmup:]
        diff = (step().float() - reference).abs().max().item()
    return {f"ours_ms_per_step[{variant}]": round(statistics.median(times), 1), f"step_max_abs_diff[{variant}]": diff}


def bench_video(model: Any, pipe: Any, params: dict[str, Any], steps: int, device: torch.device) -> dict[str, Any]:
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.sampling_params import DiffusionSamplingParams

    video_params = DiffusionSamplingParams(**params, num_inference_steps=steps)
    with torch.inference_mode():  # the VAE's first decode of this shape, outside the timings
        prepared = model.prepare(_request(video_params), video_params)
        model.decode([prepared], [prepared.latents])
    videos: dict[str, torch.Tensor] = {}

    def ours() -> None:
        engine = DiffusionEngine(model, stage_id=0, max_batch_size=1, device=str(device))
        engine.add_request(_request(video_params))
        while engine.has_work():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(out.error)
                videos["ours"] = out.multimodal_output["video"]

    def theirs() -> None:
        extra = {"guidance_scale_2": params["guidance_scale_2"]} if "guidance_scale_2" in params else {}
        with torch.no_grad():
            videos["diffusers"] = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=params["height"],
                                       width=params["width"], num_frames=params["num_frames"],
                                       num_inference_steps=steps, guidance_scale=params["guidance_scale"],
                                       generator=torch.Generator().manual_seed(params["seed"]), output_type="pt",
                                       **extra).frames.float().cpu()

    seconds = {name: wall_time(fn, device) for name, fn in (("diffusers", theirs), ("ours", ours))}
    return {"video_steps": steps, "diffusers_s_per_video": round(seconds["diffusers"], 2),
            "ours_s_per_video": round(seconds["ours"], 2),
            "video_speedup": round(seconds["diffusers"] / seconds["ours"], 3),
            "video_max_abs_diff": (videos["ours"] - videos["diffusers"]).abs().max().item()}


# --- the two step functions ----------------------------------------------------------------
def started_request(model: Any, params: dict[str, Any], steps: int) -> Any:
    from vllm_omni.diffusion.request import DiffusionRequest
    from vllm_omni.sampling_params import DiffusionSamplingParams

    sampling = DiffusionSamplingParams(**params, num_inference_steps=steps)
    request = DiffusionRequest(_request(sampling), sampling)
    with torch.inference_mode():
        request.start(model.prepare(request.request, sampling))
    assert request.prepared.do_cfg and request.expert() == 0
    return request


def ours_step_fn(model: Any, request: Any) -> Callable[[], torch.Tensor]:
    from vllm_omni.diffusion.denoise import Denoiser

    denoiser = Denoiser(model)
    return lambda: denoiser.velocities([request])[0]


def diffusers_step_fn(model: Any, request: Any) -> Callable[[], torch.Tensor]:
    """WanPipeline's loop body for this step: the conditional call, the unconditional one, guidance."""
    from vllm_omni.model_executor.models.diffusion_model import RowGroup

    p, transformer = request.prepared, model.c.transformers[0]
    batch = model.make_batch([RowGroup(p, request.latents, request.timestep(), False, 0)])
    scale = p.cfg_scale(request.step)

    def step() -> torch.Tensor:
        cond = transformer(hidden_states=batch.hidden_states, timestep=batch.timestep, encoder_hidden_states=p.prompt,
                           return_dict=False)[0]
        uncond = transformer(hidden_states=batch.hidden_states, timestep=batch.timestep,
                             encoder_hidden_states=p.negative, return_dict=False)[0]
        return uncond + scale * (cond - uncond)

    return step


def _request(params: Any) -> Any:
    from vllm_omni.stage_io import StageRequest

    return StageRequest(request_id="bench", prompt_token_ids=[], prompt=PROMPT, sampling_params=params,
                        additional_information={"negative_prompt": NEGATIVE})


# --- timing --------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    """Milliseconds of each of n calls: CUDA events on a GPU (no host wait inside the calls)."""
    if device.type != "cuda":
        out = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1000)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def release_memory(device: torch.device) -> None:
    """The previous model's weights and compiled code go before the next model loads."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def wall_time(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# --- the models ----------------------------------------------------------------------------
def diffusers_pipeline(model: Any) -> Any:
    from diffusers import WanPipeline

    c = model.c
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                       scheduler=type(c.scheduler).from_config(c.scheduler.config), transformer=c.transformers[0],
                       transformer_2=c.transformers[1] if len(c.transformers) == 2 else None,
                       boundary_ratio=c.boundary_ratio, expand_timesteps=c.expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_folder(spec: Spec) -> Path:
    from vllm_omni.testing import make_tiny_model

    return make_tiny_model("wan2_2", Path(tempfile.mkdtemp()) / spec.tiny_layout, seed=0, layout=spec.tiny_layout)


def architecture_folder(spec: Spec) -> Path:
    """A diffusers folder with the released model's component configs and no weights (load_format
    dummy). The tokenizer is the tiny one: its token ids exist in UMT5's vocabulary."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    from vllm_omni.testing.tokenizer import make_tiny_tokenizer

    root = Path(tempfile.mkdtemp(prefix="wan-arch-"))
    names = ["transformer", "transformer_2"][:spec.experts]
    configs = {name: {"_class_name": "WanTransformer3DModel", **_defaults(WanTransformer3DModel), **spec.transformer}
               for name in names}
    configs["vae"] = {"_class_name": "AutoencoderKLWan", **_defaults(AutoencoderKLWan), **spec.vae}
    configs["text_encoder"] = UMT5_XXL
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=spec.flow_shift)
    scheduler.save_pretrained(root / "scheduler")
    make_tiny_tokenizer().save_pretrained(root / "tokenizer")
    index = {"_class_name": "WanPipeline", "boundary_ratio": spec.boundary_ratio,
             "expand_timesteps": spec.expand_timesteps, "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "vae": ["diffusers", "AutoencoderKLWan"], **{n: ["diffusers", "WanTransformer3DModel"] for n in names}}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def _defaults(cls: type) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: list(p.default) if isinstance(p.default, tuple) else p.default for k, p in params.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']}, torch {result['torch']}: `{result['command']}`", "",
             "| model | size (WxHxF) | diffusers ms/step | ours ms/step | speedup | diffusers s/video | ours s/video "
             "| speedup | max abs diff (step / video) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        video = (f"{r['diffusers_s_per_video']} | {r['ours_s_per_video']} | **{r['video_speedup']}x**"
                 if "video_speedup" in r else "- | - | -")
        diffs = f"{r['step_max_abs_diff']:.3g} / {r.get('video_max_abs_diff', float('nan')):.3g}"
        lines.append(f"| {r['model']} | {r['size']} | {r['diffusers_ms_per_step']} | {r['ours_ms_per_step']} | "
                     f"**{r['step_speedup']}x** | {video} | {diffs} |")
    for r in result["rows"]:
        for key in [k for k in r if k.startswith("ours_ms_per_step[")]:
            variant = key[len("ours_ms_per_step["):-1]
            lines.append(f"\n{r['model']}, ours with {variant}: {r[key]} ms/step "
                         f"({r['diffusers_ms_per_step'] / r[key]:.3g}x diffusers), the velocity within "
                         f"{r[f'step_max_abs_diff[{variant}]']:.3g} of the default's")
    steps = {r.get("video_steps") for r in result["rows"]} - {None}
    if steps:
        lines.append(f"\nVideos: {steps.pop()} denoising steps (prompt encoding and VAE decoding included).")
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(__import__("sys").argv[1:])
