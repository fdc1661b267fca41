"""Qwen3-TTS serving benchmark: time to first audio, RTF and throughput under load.

Requests go through `AsyncOmni` (real stage processes: talker with code predictor -> code2wav),
streaming (output_partial) so the first audio is timed when the pipeline hands it on. Each
request speaks one sentence with a named voice (or clones a voice with --task Base) and
generates exactly --frames codec frames (12.5 per audio second; EOS ignored, so every run does
the same work), or, with --frames LO-HI, a number drawn per request (uniform, seeded by the
request's index: every run and mode gets the same lengths).

- closed loop: for each C in --concurrency, --num-requests requests with at most C in flight;
- open loop: --rate R sends --num-requests requests at Poisson arrivals of R requests/s.

Reported per run: time to first audio (mean / p50 / p90 / p95), end-to-end latency, RTF =
request latency / audio seconds (mean, and aggregate wall / audio), throughput in audio seconds
per second; then per stage, over all runs and the warm-up (stage_stats.py, the table of
bench_omni_e2e.py): requests, output tokens, busy seconds, early starts, pauses.
--qwen-tts-python runs qwen-tts (its reference venv, tests/reference/qwen_tts) at c=1 on the
same checkpoint for comparison: it is not streaming, so its first audio is its latency.

    python benchmarks/bench_tts.py                       # tiny random checkpoint on CPU (smoke test)
    python benchmarks/bench_tts.py --rate 4 --num-requests 16
    # GPU: the released 1.7B CustomVoice architecture with random bf16 weights
    python benchmarks/bench_tts.py --real-arch --concurrency 1,16,64 --num-requests 128 --frames 150 \
        --rate 20 --json bench_tts.json
    # a stored voice (/v1/audio/voices: its encodings in the request, no encoder runs) against a preset
    python benchmarks/bench_tts.py --real-arch --task Base --stored-voice --concurrency 1 --num-requests 32
    python benchmarks/bench_tts.py --real-arch --concurrency 1 --num-requests 32
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stage_stats import print_stage_table, stage_counters  # benchmarks/ (the script's folder)

CONFIGS = Path(__file__).resolve().parent / "configs"
REAL_CONFIG = CONFIGS / "qwen3_tts_12hz_1.7b_customvoice.json"
REAL_SPEECH_TOKENIZER = CONFIGS / "qwen3_tts_tokenizer_12hz.json"
SENTENCES = ["Hello! How are you today?", "The weather is nice today, so we are going to the park.",
             "Once upon a time there was a little girl who lived in a village near the forest.",
             "Please write a short poem about the sea and the sky.", "A journey of a thousand miles begins."]
SAMPLE_RATE = 24000


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen3-TTS checkpoint directory (default: build the tiny one)")
    p.add_argument("--real-arch", action="store_true", help="the released 1.7B architecture, random weights")
    p.add_argument("--task", default="CustomVoice", choices=["CustomVoice", "Base"])
    p.add_argument("--voices", type=int, default=1, help="Base: distinct references the requests clone "
                                                         "(0: every request its own)")
    p.add_argument("--stored-voice", action="store_true",
                   help="Base: the requests speak with a stored voice (a 2 s reference's speaker row and codes, "
                        "encoded once: random ones of the right shapes with --real-arch) instead of ref_audio")
    p.add_argument("--concurrency", default="1,16", help="comma-separated in-flight limits (closed loop)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (open loop)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per run (at least C)")
    p.add_argument("--frames", type=frame_range, default=(24, 24),
                   help="codec frames per request (12.5 per second): N, or LO-HI drawn per request")
    p.add_argument("--dtype", default=None, help="talker dtype (default: bfloat16 on GPU, the config's on CPU)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--code2wav-eager", action="store_true", help="code2wav without its CUDA graphs (enforce_eager)")
    p.add_argument("--no-predictor-graphs", action="store_true",
                   help="run the code predictor eagerly on CUDA (default: CUDA graphs, unless --eager)")
    p.add_argument("--deploy-config", default=None,
                   help="a deploy YAML instead of the bundled one (e.g. other code2wav chunk options)")
    p.add_argument("--stage-overrides", type=json.loads, default={},
                   help='JSON merged over the benchmark\'s own stage fields, e.g. \'{"1": {"runtime": {"process": false}}}\'')
    p.add_argument("--qwen-tts-python", default=None, help="python of the qwen-tts venv: also run it at c=1")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def frame_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    bounds = (int(lo), int(hi or lo))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: N or LO-HI with 0 < LO <= HI")
    return bounds


def tiny_checkpoint(task: str, out: Path) -> Path:
    from vllm_omni.testing.tiny_models import make_tiny_model

    return make_tiny_model("qwen3_tts", out, task_type=task)


def real_arch_checkpoint(out: Path, task: str = "CustomVoice") -> Path:
    """config.json of the release + the speech tokenizer's config + a tokenizer: enough for
    load_format dummy (the tiny tokenizer's ids all lie inside the real text vocabulary).

    Base (voice cloning): the CustomVoice release's config with the Base model type, no named
    speakers and a speaker encoder of the talker's width (the encoder's other sizes are
    qwen-tts' defaults, as the Base release leaves them)."""
    from vllm_omni.testing.tiny_qwen3_tts import GENERATION_CONFIG, save_tokenizer
    from vllm_omni.testing.tokenizer import make_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(REAL_CONFIG.read_text())
    if task == "Base":
        talker = config["talker_config"]
        talker["spk_id"], talker["spk_is_dialect"] = {}, {}
        config["tts_model_type"] = "base"
        config["speaker_encoder_config"] = {"enc_dim": talker["hidden_size"], "sample_rate": SAMPLE_RATE}
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    save_tokenizer(make_tiny_tokenizer(), out)
    (out / "speech_tokenizer").mkdir(exist_ok=True)
    shutil.copy(REAL_SPEECH_TOKENIZER, out / "speech_tokenizer" / "config.json")
    return out


@dataclass
class Result:
    ttfa: float
    latency: float
    audio_s: float
    start: float = 0.0  # time.perf_counter() at submission: one clock with the stage profiles' timelines


REF_TEXT = "This is my voice, please copy it."


def reference(voice: int) -> Any:
    """Reference number `voice`: a 2 s tone."""
    import numpy as np

    t = np.arange(int(2.0 * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * (140 + voice) * t)).astype("float32")


def prompt(i: int, task: str, voice: int = 0, stored: Any = None) -> dict[str, Any]:
    """Request i's prompt. Base: it clones reference number `voice`, or speaks with `stored`
    (a ClonedVoice: what /v1/audio/voices keeps)."""
    text = SENTENCES[i % len(SENTENCES)]
    if stored is not None:
        return {"prompt": text, "cloned_voice": stored}
    if task == "Base":
        return {"prompt": text, "ref_audio": (reference(voice), SAMPLE_RATE), "ref_text": REF_TEXT}
    return {"prompt": text, "speaker": "vivian"}


def stored_voice(model: Path, real_arch: bool) -> Any:
    """The 2 s reference's stored voice: encoded as the server encodes an upload, or (random
    weights, no checkpoint files) random encodings of the same shapes: its cost is in the shapes."""
    import torch

    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import ClonedVoice, VoiceEncoder

    if not real_arch:
        return VoiceEncoder.load(model).encode(torch.from_numpy(reference(0)), REF_TEXT)
    talker = json.loads((model / "config.json").read_text())["talker_config"]
    frames = int(2.0 * SAMPLE_RATE) // 1920
    codes = torch.randint(0, 2048, (frames, talker["num_code_groups"]), generator=torch.Generator().manual_seed(0))
    return ClonedVoice(torch.randn(talker["hidden_size"]) * 0.05, codes, REF_TEXT)


@dataclass
class Workload:
    """What each request asks for. Base: the talker keeps each reference's encodings
    (reference_cache.py), so only a reference it has not seen runs its two encoders: `voices`
    distinct references are cloned in turn, 0 = every request a new one (the cold path).
    Request i makes frames_of(i) codec frames: the talker's defaults with that many tokens."""
    task: str
    talker: Any  # the talker's StageConfig
    frames: tuple[int, int]
    voices: int = 1
    stored: Any = None  # a ClonedVoice every request speaks with (--stored-voice)
    _sent: itertools.count = field(default_factory=itertools.count)

    def prompt(self, i: int) -> dict[str, Any]:
        k = next(self._sent)
        return prompt(i, self.task, k % self.voices if self.voices else k, self.stored)

    def frames_of(self, i: int) -> int:
        return random.Random(i).randint(*self.frames)

    def params(self, i: int) -> list:
        n = self.frames_of(i)
        return [self.talker.new_sampling_params(max_tokens=n, min_tokens=n), None]


async def one(engine, i: int, work: Workload) -> Result:
    start, first, samples = time.perf_counter(), None, 0
    async for out in engine.generate(work.prompt(i), work.params(i), request_id=f"bench-{i}-{start}", modalities=["audio"],
                                     output_partial=True):
        if out.error is not None:
            raise RuntimeError(out.error)
        audio = out.request_output.outputs[0].multimodal_output.get("audio")
        if audio is not None and audio.numel():
            first = first or time.perf_counter()
            samples = audio.numel()
    end = time.perf_counter()
    return Result(first - start, end - start, samples / SAMPLE_RATE, start)


async def closed_loop(engine, n: int, concurrency: int, work: Workload) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> Result:
        async with gate:
            return await one(engine, i, work)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(i) for i in range(n)))
    return list(results), time.perf_counter() - start


async def open_loop(engine, n: int, rate: float, work: Workload) -> tuple[list[Result], float]:
    rng = random.Random(0)
    start, tasks = time.perf_counter(), []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one(engine, i, work)))
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(name: str, results: list[Result], wall: float) -> dict[str, Any]:
    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    ttfa, lat = [r.ttfa for r in results], [r.latency for r in results]
    audio = sum(r.audio_s for r in results)
    row = {"run": name, "requests": len(results), "ttfa_mean_ms": 1e3 * statistics.mean(ttfa),
           "ttfa_p50_ms": 1e3 * pct(ttfa, 50), "ttfa_p90_ms": 1e3 * pct(ttfa, 90), "ttfa_p95_ms": 1e3 * pct(ttfa, 95),
           "latency_p50_ms": 1e3 * pct(lat, 50), "rtf_mean": statistics.mean(r.latency / r.audio_s for r in results),
           "rtf_aggregate": wall / audio, "audio_s_per_s": audio / wall,
           "each": [{"start": r.start, "ttfa_ms": 1e3 * r.ttfa} for r in results]}
    print(f"{name:>14}: TTFA mean {row['ttfa_mean_ms']:8.1f} p50 {row['ttfa_p50_ms']:8.1f} p90 "
          f"{row['ttfa_p90_ms']:8.1f} p95 {row['ttfa_p95_ms']:8.1f} ms | latency p50 {row['latency_p50_ms']:8.1f} ms "
          f"| RTF {row['rtf_mean']:.3f} (aggregate {row['rtf_aggregate']:.3f}) | {row['audio_s_per_s']:.2f} audio s/s",
          flush=True)
    return row


def stage_overrides(args: argparse.Namespace, max_c: int) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    talker: dict[str, Any] = {"max_num_seqs": max_c, "enforce_eager": args.eager or not cuda,
                              "default_sampling_params": {"max_tokens": args.frames[1], "ignore_eos": True}}
    code2wav: dict[str, Any] = {"max_num_seqs": max_c, "enforce_eager": args.code2wav_eager}
    dtype = args.dtype or ("bfloat16" if cuda else None)
    if dtype:
        talker["dtype"] = dtype
    if args.real_arch:
        talker["load_format"] = code2wav["load_format"] = "dummy"
    overrides = {"0": talker, "1": code2wav}
    for stage_id, fields in args.stage_overrides.items():
        overrides.setdefault(str(stage_id), {}).update(fields)
    return overrides


def run_qwen_tts(python: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """qwen-tts at c=1, in its own venv, sampling with its defaults (EOS may end a request early:
    its RTF is per audio second it made)."""
    script = f"""
import time, torch, json
from qwen_tts import Qwen3TTSModel
m = Qwen3TTSModel.from_pretrained({str(model)!r}, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
                                  device_map="cuda" if torch.cuda.is_available() else "cpu")
lat, audio = [], []
for i, text in enumerate({SENTENCES!r} * 2):
    t = time.perf_counter()
    wavs, sr = m.generate_custom_voice(text, speaker="vivian", max_new_tokens={args.frames[1] + 1})
    lat.append(time.perf_counter() - t); audio.append(len(wavs[0]) / sr)
print(json.dumps({{"latency": lat[1:], "audio": audio[1:]}}))
"""
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return summarize("qwen-tts c=1", [Result(lt, lt, a) for lt, a in zip(data["latency"], data["audio"])],
                     sum(data["latency"]))


def main() -> None:
    args = parse_args()
    if args.stored_voice and args.task != "Base":
        raise SystemExit("--stored-voice needs --task Base (stored voices are cloned voices)")
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    if args.eager or args.no_predictor_graphs:  # read by the talker (stage processes inherit it)
        os.environ["VLLM_OMNI_PREDICTOR_CUDA_GRAPHS"] = "0"
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    max_c = max([*concurrency, args.num_requests if args.rate else 1])
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        elif args.real_arch:
            model = real_arch_checkpoint(Path(tmp) / "real", args.task)
        else:
            model = tiny_checkpoint(args.task, Path(tmp) / "tiny")
        rows: list[dict[str, Any]] = []
        with AsyncOmni(model=str(model), deploy_config=args.deploy_config,
                       stage_overrides=stage_overrides(args, max_c)) as engine:
            stored = stored_voice(model, args.real_arch) if args.stored_voice else None
            work = Workload(args.task, engine.pipeline.stages[0], args.frames, args.voices, stored)
            loop = asyncio.new_event_loop()
            loop.run_until_complete(closed_loop(engine, 2, 1, work))  # warm-up
            for c in concurrency:
                n = max(args.num_requests, c)
                rows.append(summarize(f"c={c}", *loop.run_until_complete(closed_loop(engine, n, c, work))))
            if args.rate:
                rows.append(summarize(f"poisson {args.rate}/s", *loop.run_until_complete(
                    open_loop(engine, args.num_requests, args.rate, work))))
            loop.close()
            stages = stage_counters(engine)
        print_stage_table({"ours": stages})
        if args.qwen_tts_python:
            if args.real_arch:
                print("qwen-tts needs real weights on disk; skipped with --real-arch")
            else:
                rows.append(run_qwen_tts(args.qwen_tts_python, model, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows, "stages": stages}, indent=1))


if __name__ == "__main__":
    main()
