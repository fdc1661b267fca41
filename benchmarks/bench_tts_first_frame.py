"""Qwen3-TTS talker on its own: the first step of a request (its prompt's prefill, the first
frame's group-0 code and its code predictor frame), which is most of the first audio at low
load, against a later decode step.

    python benchmarks/bench_tts_first_frame.py --real-arch --requests 20 [--profile DIR]
    python benchmarks/bench_tts_first_frame.py --real-arch --task Base --requests 20   # voice cloning
    python benchmarks/bench_tts_first_frame.py --real-arch --batches 1,8,32,64 [--profile DIR]
    python benchmarks/bench_tts_first_frame.py            # CPU smoke run on the tiny checkpoint

One request at a time on an idle engine (the bundled deploy config's talker: CUDA graphs,
sampling), each after the previous one has ended: the first step's wall time (the request
added -> its first frame on the host), then `--decode-steps` decode steps. `--profile DIR`
writes the torch profiler's tables of `--profile-requests` first steps and, on CUDA, every
host <-> device synchronisation inside one first step with the Python stack that caused it
(torch.cuda.set_sync_debug_mode): a synchronisation makes the host wait for all GPU work
queued before it. `--task Base`: every request clones a voice (a 2 s reference), so its first
step also encodes the reference (speaker embedding, reference codes) unless the talker has
encoded the same reference before (`--voices 1`, the default: one reference, encoded in the
warm-up; `--voices 0`: every request a reference of its own).

`--batches B,...` times steady decode steps (one frame for each of B requests) instead, the
talker's share of a loaded server; with `--profile DIR` the largest batch's steps get the
same tables, synchronisation trace and chrome trace.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_tts import prompt as tts_prompt, real_arch_checkpoint, tiny_checkpoint  # benchmarks/ (the script's folder)
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.testing.cuda_syncs import format_syncs, trace_syncs

# The bundled deploy config's talker sampling (vllm_omni/deploy/qwen3_tts.yaml, stage 0).
SAMPLING = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-arch", action="store_true", help="the released 1.7B architecture, random weights")
    p.add_argument("--task", default="CustomVoice", choices=["CustomVoice", "Base"],
                   help="Base: every request clones a voice (its reference encoded in the first step)")
    p.add_argument("--voices", type=int, default=1, help="Base: distinct references cloned in turn; the talker "
                                                         "encodes each once (0: every request a new one)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--profile", help="write the profiler tables and the synchronisation trace here")
    p.add_argument("--profile-requests", type=int, default=5)
    p.add_argument("--batches", default=None, help="comma-separated batch sizes: time steady decode steps")
    p.add_argument("--seed", type=int, default=None, help="every request's sampling seed (spec 000's default "
                                                          "sampling parameters say 42)")
    p.add_argument("--min-tokens", type=int, default=0, help="every request's min_tokens (bench_tts.py sets --frames)")
    p.add_argument("--json", default=None)
    return p.parse_args()


def first_step(engine: LLMEngine, processor: Qwen3TTSInputProcessor, i: int, params: SamplingParams,
               task: str, voices: int = 1) -> float:
    """Seconds from adding request i to its first frame on the host."""
    prompt = processor.process(tts_prompt(i, task, i % voices if voices else i))
    start = time.perf_counter()
    engine.add_request(f"r{i}", prompt["prompt_token_ids"], params, model_inputs=prompt["additional_information"])
    while not any(r.num_output_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    return time.perf_counter() - start


def decode_steps(engine: LLMEngine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def finish(engine: LLMEngine) -> None:
    engine.abort_request(list(engine.scheduler.requests))


def start_batch(engine: LLMEngine, processor: Qwen3TTSInputProcessor, batch: int, params: SamplingParams) -> None:
    """Add `batch` requests and step until each has its first frame: the next steps are decode steps."""
    for i in range(batch):
        prompt = processor.process(tts_prompt(i, "CustomVoice"))
        engine.add_request(f"b{batch}-{i}", prompt["prompt_token_ids"], params,
                           model_inputs=prompt["additional_information"])
    while not all(r.num_output_tokens for r in engine.scheduler.requests.values()):
        engine.step()


def profile_steps(run, out: Path, name: str, title: str) -> None:
    """The torch profiler's tables of `run()` (and on CUDA its synchronisations, and a chrome
    trace of a second call) in out/NAME.txt and out/NAME_trace.json."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with torch_profile(activities=activities) as prof:
        run()
    lines = [title, "top ops by self CPU time:",
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)]
    if gpu:
        lines += ["top ops by self GPU time:", prof.key_averages().table(sort_by="self_device_time_total",
                                                                           row_limit=25)]
        lines.append(format_syncs(trace_syncs(run)))
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    with torch_profile(activities=activities) as prof:  # for chrome://tracing or Perfetto
        run()
    prof.export_chrome_trace(str(out / f"{name}_trace.json"))
    print(f"profile written to {out / name}.txt")


def batch_steps(engine, processor, args) -> dict[str, float]:
    """ms per steady decode step at each of --batches (p50 of --decode-steps steps)."""
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(**SAMPLING, ignore_eos=True, max_tokens=1 << 20, detokenize=False, seed=args.seed,
                            min_tokens=args.min_tokens)
    result = {}
    for batch in batches:
        start_batch(engine, processor, batch, params)
        decode_steps(engine, 5)  # warm-up
        result[f"batch_{batch}_ms_p50"] = 1e3 * statistics.median(decode_steps(engine, args.decode_steps))
        print(f"batch {batch}: {result[f'batch_{batch}_ms_p50']:.2f} ms per decode step (p50)", flush=True)
        if args.profile and batch == max(batches):
            profile_steps(lambda: decode_steps(engine, 5), Path(args.profile), f"tts_batch{batch}_profile",
                          f"5 decode steps at batch {batch}")
        finish(engine)
    return result


def profile(engine, processor, params, args, out: Path) -> None:
    def run() -> None:
        for i in range(args.profile_requests):
            first_step(engine, processor, 1000 + i, params, args.task, args.voices)
            finish(engine)

    profile_steps(run, out, "tts_first_frame_profile", f"{args.profile_requests} first steps")


def main() -> None:
    args = parse_args()
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        model = real_arch_checkpoint(Path(tmp) / "real", args.task) if args.real_arch else tiny_checkpoint(
            args.task, Path(tmp) / "tiny")
        engine = LLMEngine(EngineConfig(
            model=str(model), model_stage="talker", architecture="Qwen3TTSForConditionalGeneration",
            device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "auto",
            load_format="dummy" if args.real_arch else "auto", max_num_seqs=64, enable_prefix_caching=False,
            max_num_batched_tokens=32768, gpu_memory_utilization=0.5, enforce_eager=args.eager))
        processor = Qwen3TTSInputProcessor(model)
        if args.batches:
            result = batch_steps(engine, processor, args)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))
            return
        params = SamplingParams(**SAMPLING, ignore_eos=True, max_tokens=args.decode_steps + 8, detokenize=False)
        for i in range(args.warmup):
            first_step(engine, processor, -1 - i, params, args.task, args.voices)
            decode_steps(engine, args.decode_steps)
            finish(engine)
        firsts, decodes = [], []
        for i in range(args.requests):
            firsts.append(first_step(engine, processor, i, params, args.task, args.voices))
            decodes += decode_steps(engine, args.decode_steps)
            finish(engine)
        result = {"first_step_ms_p50": 1e3 * statistics.median(firsts), "first_step_ms_min": 1e3 * min(firsts),
                  "decode_step_ms_p50": 1e3 * statistics.median(decodes),
                  "device": torch.cuda.get_device_name() if gpu else "cpu"}
        print(f"first step {result['first_step_ms_p50']:.2f} ms p50 (min {result['first_step_ms_min']:.2f}), "
              f"decode step {result['decode_step_ms_p50']:.2f} ms p50", flush=True)
        if args.profile:
            profile(engine, processor, params, args, Path(args.profile))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
