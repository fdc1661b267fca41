"""Qwen3-TTS serving benchmark: first audio, playback underruns, RTF and throughput under
sustained load, in-process (`AsyncOmni`) or over HTTP (`vllm-omni serve`, streamed
`/v1/audio/speech`, timed by the `vllm bench serve` client in this process), or both in one run.

Each request speaks one sentence with a named voice (or clones a voice with --task Base,
in-process only) and generates exactly --frames codec frames (12.5 per audio second; EOS
ignored, so every run does the same work), or, with --frames LO-HI, a number drawn per request
(uniform, seeded by the request's index: every run and mode gets the same lengths).

- closed loop: for each C in --concurrency, at least 4 x C requests with at most C in flight;
- open loop: for each R in --rate, Poisson arrivals at R requests/s for at least 30 s
  (--num-requests is raised to what sustained load needs; --allow-short keeps it, for a quick
  check, not a measurement);
- the first 10% of each run's requests are warm-up, reported apart.

Reported per run (bench_load.py, with vllm bench serve's metrics): first audio p50/p90/p95/p99,
e2e, RTF, requests/s, audio seconds per second, playback underruns (a chunk arriving after
everything before it has played, for a listener that starts at the first chunk) and the worst
gap; each request's first audio in send order and the slowest requests' stage timings
(log_stats); then per stage (stage_stats.py): requests, output tokens, busy seconds, early
starts, pauses. --mode both runs the same workload in-process, then over HTTP, and reports the
HTTP path's cost on first audio p50 (target: <= 5 ms).
--qwen-tts-python runs qwen-tts (its reference venv, tests/reference/qwen_tts) at c=1 on the
same checkpoint for comparison: it is not streaming, so its first audio is its latency.

    python benchmarks/bench_tts.py --allow-short                 # tiny random checkpoint on CPU (smoke test)
    # GPU: the released 1.7B CustomVoice architecture with random bf16 weights, 3-8 s utterances
    python benchmarks/bench_tts.py --real-arch --frames 38-100 --concurrency "" --rate 1,10,20,40 --json tts.json
    python benchmarks/bench_tts.py --real-arch --frames 38-100 --concurrency "" --rate 10 --mode both
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
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_load  # benchmarks/ (the script's folder)
from bench_load import Run

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
    p.add_argument("--rate", default="", help="comma-separated Poisson arrival rates per second (open loop)")
    p.add_argument("--num-requests", type=int, default=16,
                   help="requests per run, raised to 4 x C (closed) or 30 s of arrivals (open)")
    p.add_argument("--allow-short", action="store_true", help="keep --num-requests as given (a quick check)")
    p.add_argument("--mode", choices=("inproc", "http", "both"), default="inproc",
                   help="AsyncOmni in this process, vllm-omni serve over HTTP, or both (the HTTP cost)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="both stages' max_num_seqs (default: the largest concurrency, at least 64)")
    p.add_argument("--admission-policy", choices=("off", "queue", "reject"), default="off",
                   help="admission by playback load (docs/streaming.md)")
    p.add_argument("--timelines", type=int, default=3, help="stage timings of the N slowest first audios per run")
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

    from vllm_omni.model_executor.models.cloned_voice import ClonedVoice
    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder

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

    # (In HTTP mode `talker` is None: the server applies the same stage defaults, and each request
    # sends max_new_tokens = frames_of(i).)


def request_id(i: int) -> str:
    return f"bench-{i}"


async def run_inproc(engine: Any, work: Workload, run: Run) -> tuple[list, float]:
    return await bench_load.drive(lambda i: bench_load.inproc_request(
        engine, work.prompt(i), work.params(i), f"{request_id(i)}-{run.name}", modalities=["audio"]), run,
        state=lambda: bench_load.pipeline_state(engine))


async def run_http(server: bench_load.Server, work: Workload, run: Run) -> tuple[list, float]:
    from vllm_omni.entrypoints.cli.bench import runner
    from vllm_omni.entrypoints.cli.bench.datasets import SampleRequest

    samples = [SampleRequest(SENTENCES[i % len(SENTENCES)], 0, work.frames_of(i)) for i in range(run.num_requests)]
    return await runner.run("openai-audio-speech", server.target("/v1/audio/speech", {"voice": "vivian"}), samples,
                            rate=run.rate or float("inf"), burstiness=1.0, max_concurrency=run.concurrency, seed=0,
                            timeout_s=600.0)


def stage_overrides(args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    # Not the request count of an open-loop run (400 requests made 400-row batches): the bundled 64.
    max_seqs = args.max_num_seqs or max([64, *(r.concurrency or 0 for r in runs)])
    talker: dict[str, Any] = {"max_num_seqs": max_seqs, "enforce_eager": args.eager or not cuda,
                              "default_sampling_params": {"max_tokens": args.frames[1], "ignore_eos": True}}
    code2wav: dict[str, Any] = {"max_num_seqs": max_seqs, "enforce_eager": args.code2wav_eager}
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
    its RTF is per audio second it made); not streaming: its first audio is its latency."""
    from vllm_omni.entrypoints.cli.bench.backends import RequestResult

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
    results = [RequestResult(success=True, latency=lt, audio_chunks=[(lt, a)]) for lt, a in
               zip(data["latency"], data["audio"])]
    run = Run("qwen-tts c=1", len(results), concurrency=1)
    return bench_load.summarize(run, results, sum(data["latency"]))


def plan_runs(args: argparse.Namespace) -> list[Run]:
    runs = [Run.closed(int(c), args.num_requests) for c in args.concurrency.split(",") if c]
    runs += [Run.poisson(float(r), args.num_requests) for r in args.rate.split(",") if r]
    return [bench_load.sustain(run, args.allow_short) for run in runs]


def bench_inproc(model: Path, args: argparse.Namespace, runs: list[Run], save) -> dict[str, Any]:
    from stage_stats import print_stage_table, stage_counters

    from vllm_omni.entrypoints.async_omni import AsyncOmni

    stage_log = bench_load.StageLog.install()
    t0 = time.perf_counter()
    with AsyncOmni(model=str(model), deploy_config=args.deploy_config, stage_overrides=stage_overrides(args, runs),
                   log_stats=True, admission_policy=args.admission_policy) as engine:
        print(f"pipeline up in {time.perf_counter() - t0:.1f} s", flush=True)
        bench_load.serving_process()
        stored = stored_voice(model, args.real_arch) if args.stored_voice else None
        work = Workload(args.task, engine.pipeline.stages[0], args.frames, args.voices, stored)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(bench_load.warm_up(lambda run: run_inproc(engine, work, run)))
        rows = bench_load.measure(runs, lambda run: loop.run_until_complete(run_inproc(engine, work, run)),
                                  "in-process", lambda run, i: f"{request_id(i)}-{run.name}", stage_log,
                                  lambda rows: save({"rows": rows}))
        loop.close()
        stages = stage_counters(engine)
    print_stage_table({"ours": stages})
    return {"rows": rows, "stages": stages}


def bench_http(model: Path, args: argparse.Namespace, runs: list[Run], log_dir: Path, save) -> dict[str, Any]:
    if args.task != "CustomVoice":
        raise SystemExit("--mode http / both: CustomVoice only (the speech client sends a named voice)")
    serve_args = ["--stage-overrides", json.dumps(stage_overrides(args, runs)), "--log-stats",
                  "--admission-policy", args.admission_policy]
    if args.deploy_config:
        serve_args += ["--deploy-config", args.deploy_config]
    t0 = time.perf_counter()
    with bench_load.Server(str(model), serve_args, log_dir / "server.log") as server:
        print(f"server up in {time.perf_counter() - t0:.1f} s", flush=True)
        work = Workload(args.task, None, args.frames, args.voices)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(bench_load.warm_up(lambda run: run_http(server, work, run)))
        rows = bench_load.measure(runs, lambda run: loop.run_until_complete(run_http(server, work, run)), "HTTP",
                                  save=lambda rows: save({"rows": rows}))
        loop.close()
    return {"rows": rows}


def main() -> None:
    args = parse_args()
    if args.stored_voice and args.task != "Base":
        raise SystemExit("--stored-voice needs --task Base (stored voices are cloned voices)")
    if args.eager or args.no_predictor_graphs:  # read by the talker (stage processes inherit it)
        os.environ["VLLM_OMNI_PREDICTOR_CUDA_GRAPHS"] = "0"
    runs = plan_runs(args)
    result: dict[str, Any] = {"args": vars(args), "runs": [vars(r) for r in runs]}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        elif args.real_arch:
            model = real_arch_checkpoint(Path(tmp) / "real", args.task)
        else:
            model = tiny_checkpoint(args.task, Path(tmp) / "tiny")
        def saver(key: str):
            def save(value: dict[str, Any]) -> None:
                result[key] = value
                bench_load.write_json(args.json, result)
            return save

        if args.mode in ("inproc", "both"):
            result["inproc"] = bench_inproc(model, args, runs, saver("inproc"))
        if args.mode in ("http", "both"):
            log_dir = Path(args.json).resolve().parent if args.json else Path(tmp)
            result["http"] = bench_http(model, args, runs, log_dir, saver("http"))
        if args.mode == "both":
            result["http_vs_inproc"] = [bench_load.compare_http(a, b) for a, b in
                                        zip(result["inproc"]["rows"], result["http"]["rows"])]
        if args.qwen_tts_python:
            if args.real_arch:
                print("qwen-tts needs real weights on disk; skipped with --real-arch")
            else:
                result["qwen_tts"] = run_qwen_tts(args.qwen_tts_python, model, args)
                bench_load.print_rows([result["qwen_tts"]])
    bench_load.write_json(args.json, result)


if __name__ == "__main__":
    main()
