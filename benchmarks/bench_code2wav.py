"""Code2wav stages on their own: whole requests and streaming chunks at batch 1, 8, 32, for
Qwen3-Omni code2wav, Qwen2.5-Omni token2wav and Qwen3-TTS code2wav (`qwen3_tts`), with random
weights of the real architectures (`load_format="dummy"`, configs in benchmarks/configs),
against each call's roofline.

    python benchmarks/bench_code2wav.py --families qwen2_5 --precision float32,tf32,bfloat16 --json t2w.json
    python benchmarks/bench_code2wav.py --families qwen3 --precision float32,tf32,bfloat16 --json c2w.json
    python benchmarks/bench_code2wav.py --families qwen3_tts --precision tf32 --skip-hf --profile 25
    python benchmarks/bench_code2wav.py --tiny --device cpu --batches 1,2 --seconds 2   # CPU smoke test

(One family per command keeps a run within minutes: Qwen2.5 at batch 32 in float32 decodes
320 s of audio through 36 DiT evaluations per call.)

Per family, precision and batch size B (B requests of about --seconds of audio each, lengths
spread +-20% so that rows differ):
- whole: one `generate_batch` of the B requests: ms per call and GPU seconds per 10 s of audio;
- stream: B streams fed all their codes, decoded by `decode_streams` steps until done: ms of
  the first step (every first chunk), mean ms per later step, ms per chunk, GPU seconds per
  10 s of audio;
- roofline: the call's FLOPs (torch's FlopCounterMode) over the peak of its precision, or its
  bytes (each leaf module's weights per call + its output written and read once) over HBM
  bandwidth, whichever is longer; measured / roofline says how far from the floor it runs.
- transformers at B=1 (whole request, its own decode) for comparison, unless --skip-hf (Qwen3-TTS
  has no transformers model);
- DiT %: for Qwen2.5, the share of the streamed steps spent in the DiT's ODE solve (the rest is
  the vocoder and host work);
- --profile N: the N kernels with the most GPU time over one whole call and one streamed run at each batch
  (eager: every kernel by name).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest

CONFIGS = {"qwen3": "qwen3_omni_30b_a3b.json", "qwen2_5": "qwen2_5_omni_7b.json"}
TINY = {"qwen3": "qwen3_omni_moe", "qwen2_5": "qwen2_5_omni", "qwen3_tts": "qwen3_tts"}
UNITS_PER_SECOND = {"qwen3": 12.5, "qwen2_5": 50.0, "qwen3_tts": 12.5}  # codec frames / codes per audio second
FRAMED = ("qwen3", "qwen3_tts")  # codes come in frames of num_quantizers
# H200 ceilings: HBM and bf16 dense measured (../shared/notes/gpu.md); TF32 and plain float32
# scaled from the spec sheet's ratios to bf16 (1/2 and about 1/15).
HBM_BYTES_PER_S = 4.27e12
PEAK_FLOPS = {"bfloat16": 790e12, "tf32": 395e12, "float32": 53e12}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="qwen3,qwen2_5")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--seconds", type=float, default=10.0, help="audio per request")
    p.add_argument("--precision", default="float32", help="comma list of float32, tf32, bfloat16")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    p.add_argument("--steps", type=int, default=10, help="Qwen2.5 DiT ODE steps")
    p.add_argument("--repeats", type=int, default=2, help="timed whole calls after the counted warm-up")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-configs", default=str(Path(__file__).resolve().parent / "configs"))
    p.add_argument("--tiny", action="store_true", help="tiny random checkpoints (CPU smoke test)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="print the N kernels with the most GPU time per batch, whole and streamed")
    p.add_argument("--json", default="bench_code2wav.json")
    return p.parse_args()


def checkpoint(family: str, args) -> tuple[str, str]:
    """(model dir, load_format) of the family."""
    out = Path(tempfile.mkdtemp()) / family
    if args.tiny:
        from vllm_omni.testing.tiny_models import make_tiny_model

        return str(make_tiny_model(TINY[family], out)), "auto"
    if family == "qwen3_tts":
        from bench_tts import real_arch_checkpoint  # benchmarks/ (the script's folder)

        return str(real_arch_checkpoint(out)), "dummy"
    from vllm_omni.testing.dummy_checkpoints import make_dummy_omni_checkpoint

    return str(make_dummy_omni_checkpoint(Path(args.model_configs) / CONFIGS[family], out)), "dummy"


def load(family: str, path: str, load_format: str, precision: str, args):
    device = torch.device(args.device)
    if family == "qwen3":
        from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav import Qwen3OmniMoeCode2Wav

        return Qwen3OmniMoeCode2Wav.load(path, device=device, load_format=load_format, precision=precision,
                                         compile_mode=args.compile_mode)
    if family == "qwen3_tts":
        from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav

        return Qwen3TTSCode2Wav.load(path, device=device, load_format=load_format, precision=precision)
    from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav

    return Qwen2_5OmniToken2Wav.load(path, device=device, load_format=load_format, precision=precision,
                                     num_steps=args.steps, compile_mode=args.compile_mode)


def requests(family: str, model, batch: int, seconds: float) -> list[StageRequest]:
    g = torch.Generator().manual_seed(batch)
    out = []
    for i in range(batch):
        units = max(1, round(seconds * UNITS_PER_SECOND[family] * (0.8 + 0.4 * i / max(1, batch - 1))))
        if family in FRAMED:
            codes = torch.randint(0, model.codebook_size, (model.num_quantizers * units,), generator=g)
        else:
            codes = torch.randint(0, model.dit.config.num_embeds, (units,), generator=g)
        out.append(StageRequest(request_id=f"r{i}", prompt_token_ids=codes.tolist(), sampling_params=SamplingParams(seed=i)))
    return out


def audio_seconds(results: list[dict]) -> float:
    return sum(r["audio"].numel() for r in results) / 24000


def timed(fn, sync):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def counted(fn, precision: str):
    """Run fn once (the warm-up), counting its FLOPs and bytes: (fn's result, roofline dict)."""
    moved = [0]

    def count(module, inputs, output):
        if next(module.children(), None) is None:  # leaf modules only
            weights = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            outs = output if isinstance(output, (tuple, list)) else (output,)
            moved[0] += weights + sum(2 * o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        with FlopCounterMode(display=False) as flops:
            result = fn()
    finally:
        handle.remove()
    total = flops.get_total_flops()
    floor = max(total / PEAK_FLOPS[precision], moved[0] / HBM_BYTES_PER_S)
    return result, {"gflop": total / 1e9, "gbytes": moved[0] / 1e9, "roofline_ms": floor * 1e3}


def bench_whole(model, reqs, args, precision, sync) -> dict:
    results, floor = counted(lambda: model.generate_batch(reqs), precision)
    ms = statistics.median(timed(lambda: model.generate_batch(reqs), sync)[0] for _ in range(args.repeats)) * 1e3
    return {"ms_per_call": ms, "gpu_s_per_10s_audio": ms / 1e3 / audio_seconds(results) * 10,
            "x_roofline": ms / floor["roofline_ms"], **floor}


def open_streams(family: str, model, reqs) -> list:
    """One stream per request, fed all its units (the chunking is the same however they come)."""
    streams = []
    for req in reqs:
        stream = model.open_stream(StageRequest(request_id=req.request_id, prompt_token_ids=[],
                                                sampling_params=req.sampling_params))
        units = torch.tensor(req.prompt_token_ids)
        stream.push(units.view(model.num_quantizers, -1).T if family in FRAMED else units, final=True)
        streams.append(stream)
    return streams


def drain(model, streams, sync) -> tuple[list[float], int, float]:
    """Decode steps until every stream is done: (seconds per step, chunks, audio seconds)."""
    steps, chunks, seconds = [], 0, 0.0
    while ready := [s for s in streams if s.ready()]:
        elapsed, outs = timed(lambda: model.decode_streams(ready), sync)
        steps.append(elapsed)
        chunks += len(ready)
        seconds += audio_seconds(outs)
    return steps, chunks, seconds


@contextlib.contextmanager
def time_spent_in(obj, method: str, sync):
    """Seconds of each call of obj.method (synchronized on both sides) while the block runs."""
    spent: list[float] = []
    original = getattr(obj, method)

    def timed_call(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            spent.append(time.perf_counter() - start)

    setattr(obj, method, timed_call)
    try:
        yield spent
    finally:
        delattr(obj, method)


def bench_stream(family: str, model, reqs, precision, sync) -> dict:
    _, floor = counted(lambda: drain(model, open_streams(family, model, reqs), sync), precision)
    # Qwen2.5: how much of each step is the DiT's ODE solve (the rest: the vocoder, host work).
    solve = time_spent_in(model, "_sample_mels", sync) if family == "qwen2_5" else contextlib.nullcontext([])
    with solve as dit:
        steps, chunks, seconds = drain(model, open_streams(family, model, reqs), sync)
    later = steps[1:] or steps
    return {"first_step_ms": steps[0] * 1e3, "later_step_ms": statistics.mean(later) * 1e3,
            "ms_per_chunk": sum(steps) * 1e3 / chunks, "steps": len(steps),
            "gpu_s_per_10s_audio": sum(steps) / seconds * 10, "x_roofline": sum(steps) * 1e3 / floor["roofline_ms"],
            "dit_share": sum(dit) / sum(steps) if dit else None, **floor}


def print_kernels(family: str, model, reqs, sync, top: int) -> None:
    """The kernels, and the torch ops that launch them, with the most GPU time over one whole call
    and over one streamed run of the requests (CPU: ops by CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    runs = {"one whole call": lambda: model.generate_batch(reqs),
            "streams": lambda: drain(model, open_streams(family, model, reqs), sync)}
    for name, run in runs.items():
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            run()
            sync()
        print(f"--- {family}, {len(reqs)} requests, {name}: top {top} kernels and ops by {'GPU' if cuda else 'CPU'} time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=top, max_name_column_width=110))


def bench_hf(family: str, model, req, sync) -> dict:
    """transformers' own decode of one whole request (its module, the same weights)."""
    if family == "qwen3":
        codes = torch.tensor(req.prompt_token_ids, device=model.device).view(1, model.num_quantizers, -1)
        run = lambda: model.module.chunked_decode(codes, chunk_size=300, left_context_size=25)  # noqa: E731
        samples = codes.shape[-1] * model.samples_per_frame
    else:
        from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_vocoder import hop_length

        codes = torch.tensor(req.prompt_token_ids, device=model.device)[None]
        voice = model.speakers["Chelsie"]
        run = lambda: model.module(codes, voice.cond.to(model.device), voice.ref_mel.to(model.device),  # noqa: E731
                                   num_steps=model.num_steps)
        samples = codes.shape[-1] * model.dit.repeats * hop_length(model.bigvgan)
    with torch.inference_mode():
        run()
        elapsed = timed(run, sync)[0]
    return {"ms_per_call": elapsed * 1e3, "gpu_s_per_10s_audio": elapsed / (samples / 24000) * 10}


def main():
    args = parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for family in args.families.split(","):
        path, load_format = checkpoint(family, args)
        for precision in args.precision.split(","):
            model = load(family, path, load_format, precision, args)
            for batch in [int(b) for b in args.batches.split(",")]:
                reqs = requests(family, model, batch, args.seconds)
                row = {"family": family, "precision": precision, "batch": batch,
                       "whole": bench_whole(model, reqs, args, precision, sync),
                       "stream": bench_stream(family, model, reqs, precision, sync)}
                rows.append(row)
                print(json.dumps(row))
                if args.profile:
                    print_kernels(family, model, reqs, sync, args.profile)
            if not args.skip_hf and precision == "float32" and family != "qwen3_tts":
                rows.append({"family": family, "precision": precision, "batch": 1, "transformers":
                             bench_hf(family, model, requests(family, model, 1, args.seconds)[0], sync)})
                print(json.dumps(rows[-1]))
    print_table(rows)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def print_table(rows):
    print(f"\n{'family':8} {'prec':9} {'B':>3} | {'whole ms':>9} {'s/10s':>6} {'roof ms':>8} {'x roof':>6} | "
          f"{'1st step':>8} {'step ms':>8} {'ms/chunk':>8} {'s/10s':>6} {'x roof':>6} {'DiT %':>5}")
    for r in rows:
        if "transformers" in r:
            t = r["transformers"]
            print(f"{r['family']:8} {'HF fp32':9} {1:>3} | {t['ms_per_call']:9.1f} {t['gpu_s_per_10s_audio']:6.3f}")
            continue
        w, s = r["whole"], r["stream"]
        dit_share = "" if s["dit_share"] is None else f"{100 * s['dit_share']:5.0f}"
        print(f"{r['family']:8} {r['precision']:9} {r['batch']:>3} | {w['ms_per_call']:9.1f} "
              f"{w['gpu_s_per_10s_audio']:6.3f} {w['roofline_ms']:8.2f} {w['x_roofline']:6.1f} | "
              f"{s['first_step_ms']:8.1f} {s['later_step_ms']:8.1f} {s['ms_per_chunk']:8.1f} "
              f"{s['gpu_s_per_10s_audio']:6.3f} {s['x_roofline']:6.1f} {dit_share:>5}")


if __name__ == "__main__":
    main()
