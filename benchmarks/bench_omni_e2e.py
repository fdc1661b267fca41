"""End to end Qwen2.5-Omni / Qwen3-Omni (thinker -> talker -> code2wav): our pipeline under
sustained load, in-process or over HTTP, and transformers at one request.

Each request is a chat prompt; the reply has a fixed length (EOS ignored): `--text-tokens`
thinker tokens, `--codec-tokens` talker codes, greedy, code2wav with its default 10 ODE steps.
Ours runs through `AsyncOmni` (real stage processes) with at most C requests in flight for
each C in `--concurrency` (at least 4 x C requests: --num-requests is raised unless
--allow-short; the first 10% are warm-up, reported apart), streaming (output_partial) to time
the first text token and each audio chunk. `--mode http` runs the same workload through
`vllm-omni serve` (streamed chat completions with audio, timed by the `vllm bench serve` client
in this process), `--mode both` does both and reports the HTTP path's cost on first audio p50.
transformers runs `generate` one request at a time in this process.

Ours runs twice in the same run by default (`--async-chunk both`): with streaming edges
(async_chunk: the talker starts on the thinker's first tokens, code2wav on the talker's first
codes) and without (each stage hands its finished output to the next).

Reported per engine and concurrency (bench_load.py, vllm bench serve's metrics): first audio
p50/p90/p95/p99, TTFT, e2e, RTF, requests/s, playback underruns (a chunk arriving after
everything before it has played, for a client that starts playing at the first chunk) and the
worst gap; each request's first audio in send order and the slowest requests' stage timings
(log_stats). Per stage (the orchestrator's counters): requests, tokens, busy time, early starts
over streaming edges, flow-control pauses.

    python benchmarks/bench_omni_e2e.py --allow-short                  # tiny random checkpoint, CPU
    python benchmarks/bench_omni_e2e.py --model DIR --concurrency 1,8,32 --skip-hf
    # GPU, real architecture, random bf16 weights (Qwen2.5-Omni-7B or Qwen3-Omni-30B-A3B):
    python benchmarks/bench_omni_e2e.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
        --concurrency 1,8,32 --prompt-words 100 --text-tokens 128 --codec-tokens 500

With --dummy-config every stage runs with load_format "dummy" (random weights of the real
shapes), CUDA graphs on, bf16 decoders; prompts are token ids laid out as a ChatML turn in the
real vocabulary (`vllm_omni.testing.dummy_checkpoints.chat_prompt_ids`). transformers runs the
same architecture from its config with random weights, after ours has released the GPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_load  # benchmarks/ (the script's folder)
import torch
import transformers
from bench_load import Run
from stage_stats import print_stage_table, stage_counters

WORDS = ("river mountain city music light garden ocean story morning window paper bridge voice "
         "forest winter market dream silver orange travel").split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen2.5-Omni checkpoint directory (default: build the tiny one)")
    p.add_argument("--dummy-config", help="real config.json: random weights of that architecture (GPU)")
    p.add_argument("--concurrency", default="1,4", help="comma-separated in-flight request limits")
    p.add_argument("--num-requests", type=int, default=8, help="requests per concurrency level (raised to 4 x C)")
    p.add_argument("--allow-short", action="store_true", help="keep --num-requests as given (a quick check)")
    p.add_argument("--mode", choices=("inproc", "http", "both"), default="inproc",
                   help="AsyncOmni in this process, vllm-omni serve over HTTP, or both (the HTTP cost)")
    p.add_argument("--admission-policy", choices=("off", "queue", "reject"), default="off",
                   help="admission by playback load (docs/streaming.md)")
    p.add_argument("--prompt-words", type=int, default=12)
    p.add_argument("--text-tokens", type=int, default=16)
    p.add_argument("--codec-tokens", type=int, default=64)
    p.add_argument("--hf-requests", type=int, default=4, help="transformers requests (one at a time)")
    p.add_argument("--dtype", default=None, help="stage dtype (default: the configs'); transformers: float32 "
                                                 "on CPU, bfloat16 on GPU")
    p.add_argument("--stage-configs-path", default=None)
    p.add_argument("--deploy-config", default=None)
    p.add_argument("--stage-overrides", type=json.loads, default=None,
                   help="JSON; default: max_num_seqs = max concurrency")
    p.add_argument("--hf-threads", type=int, default=None, help="torch threads for transformers (default: torch's)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--async-chunk", choices=("both", "on", "off"), default="both",
                   help="run ours with streaming edges, without, or both (same run)")
    p.add_argument("--log-requests", action="store_true",
                   help="log every request's stage timings (the slowest ones are printed anyway)")
    p.add_argument("--json", default="bench_omni_e2e.json")
    return p.parse_args()


DUMMY = False  # set from --dummy-config: prompts become real-vocabulary token ids
# With random weights and EOS ignored a talker also samples its special ids, which no vocoder
# decodes: with --dummy-config the talker may only sample real codes [0, NUM_CODES).
NUM_CODES: int | None = None


def fixed_length_params(args: argparse.Namespace) -> list[dict[str, Any]]:
    # min_tokens masks the codec EOS (as transformers' talker_min_new_tokens does): ignored, a
    # sampled EOS would still be a code, which code2wav rejects (the tiny models sample it).
    talker = {"temperature": 0.0, "max_tokens": args.codec_tokens, "min_tokens": args.codec_tokens, "ignore_eos": True}
    if NUM_CODES is not None:
        talker["allowed_token_ids"] = list(range(NUM_CODES))
    return [{"temperature": 0.0, "max_tokens": args.text_tokens, "ignore_eos": True}, talker, {"seed": 0}]


def codec_code_count(config: dict[str, Any]) -> int:
    if "code2wav_config" in config:  # Qwen3-Omni: RVQ codebook
        return config["code2wav_config"]["codebook_size"]
    return config["token2wav_config"]["dit_config"]["num_embeds"]  # Qwen2.5-Omni token2wav


def text_prompts(n: int, words: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return ["Tell me about " + " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (words,), generator=g).tolist())
            + "." for _ in range(n)]


def make_prompts(n: int, words: int, http: bool = False) -> list[dict[str, Any]]:
    """In-process prompts; in the HTTP modes chat text for both paths (the server takes chat
    messages), else token ids laid out as a ChatML turn with --dummy-config."""
    if DUMMY and not http:
        from vllm_omni.testing.dummy_checkpoints import chat_prompt_ids

        return [{"prompt_token_ids": chat_prompt_ids(words, seed=i)} for i in range(n)]
    return [{"messages": [{"role": "user", "content": text}]} for text in text_prompts(n, words)]


def plan_runs(args: argparse.Namespace) -> list[Run]:
    return [bench_load.sustain(Run.closed(int(c), args.num_requests), args.allow_short)
            for c in args.concurrency.split(",") if c]


def stage_overrides(args: argparse.Namespace, runs: list[Run], http: bool) -> dict[str, Any]:
    """max_num_seqs = the largest concurrency; with --dummy-config random weights, CUDA graphs and
    bf16 decoders. Over HTTP the talker's and code2wav's fixed-length sampling are their stage
    defaults (a chat request's sampling fields reach the thinker only)."""
    top = max(r.concurrency or 1 for r in runs)
    overrides = args.stage_overrides or {str(s): {"max_num_seqs": top} for s in range(3)}
    if DUMMY:
        for stage, values in overrides.items():
            values["load_format"] = "dummy"
            if stage in ("0", "1"):  # the AR stages: CUDA graphs and bf16
                values.update(enforce_eager=False, dtype="bfloat16")
    if http:
        _, talker, code2wav = fixed_length_params(args)
        overrides.setdefault("1", {})["default_sampling_params"] = talker
        overrides.setdefault("2", {})["default_sampling_params"] = code2wav
    return overrides


def bench_inproc(model: str, args: argparse.Namespace, runs: list[Run], async_chunk: bool) -> dict[str, Any]:
    from vllm_omni import AsyncOmni

    engine_args = {"dtype": args.dtype} if args.dtype else {}
    stage_log = bench_load.StageLog.install()
    t0 = time.perf_counter()
    omni = AsyncOmni(model, stage_configs_path=args.stage_configs_path, deploy_config=args.deploy_config,
                     stage_overrides=stage_overrides(args, runs, http=False), async_chunk=async_chunk, log_stats=True,
                     admission_policy=args.admission_policy, **engine_args)
    startup = time.perf_counter() - t0
    bench_load.serving_process()
    params = fixed_length_params(args)
    http_prompts = args.mode == "both"  # the same chat text as the HTTP run

    def send(run: Run):
        prompts = make_prompts(run.num_requests, args.prompt_words, http=http_prompts)
        return bench_load.drive(lambda i: bench_load.inproc_request(omni, prompts[i], params, f"{run.name}-{i}"), run,
                                state=lambda: bench_load.pipeline_state(omni))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(bench_load.warm_up(send))
        rows = bench_load.measure(runs, lambda run: loop.run_until_complete(send(run)),
                                  f"in-process, async_chunk {'on' if async_chunk else 'off'}",
                                  lambda run, i: f"{run.name}-{i}", stage_log)
        stages = stage_counters(omni)
    finally:
        loop.close()
        omni.close()
    return {"startup_s": startup, "async_chunk": async_chunk, "rows": rows, "stages": stages}


def bench_http(model: str, args: argparse.Namespace, runs: list[Run], async_chunk: bool) -> dict[str, Any]:
    from vllm_omni.entrypoints.cli.bench import runner
    from vllm_omni.entrypoints.cli.bench.datasets import SampleRequest

    serve_args = ["--stage-overrides", json.dumps(stage_overrides(args, runs, http=True)), "--log-stats",
                  "--admission-policy", args.admission_policy, "--async-chunk" if async_chunk else "--no-async-chunk"]
    for flag, value in (("--stage-configs-path", args.stage_configs_path), ("--deploy-config", args.deploy_config),
                        ("--dtype", args.dtype)):
        serve_args += [flag, value] if value else []
    thinker = {"temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    with bench_load.Server(model, serve_args, Path(args.json).resolve().parent / "server.log") as server:
        startup = time.perf_counter() - t0
        target = server.target("/v1/chat/completions", thinker)

        async def send(run: Run) -> tuple[list, float]:
            samples = [SampleRequest(text, 0, args.text_tokens) for text in
                       text_prompts(run.num_requests, args.prompt_words)]
            return await runner.run("openai-chat-omni", target, samples, rate=float("inf"), burstiness=1.0,
                                    max_concurrency=run.concurrency, seed=0, timeout_s=600.0)

        loop = asyncio.new_event_loop()
        loop.run_until_complete(bench_load.warm_up(send))
        rows = bench_load.measure(runs, lambda run: loop.run_until_complete(send(run)),
                                  f"HTTP, async_chunk {'on' if async_chunk else 'off'}")
        loop.close()
    return {"startup_s": startup, "async_chunk": async_chunk, "rows": rows}


# --------------------------------------------------------------------------------- transformers


def load_hf(model: str, device: str, dtype: torch.dtype):
    """transformers' model for the checkpoint's family; random weights with --dummy-config."""
    from transformers import AutoConfig, Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration

    config = AutoConfig.from_pretrained(model)
    qwen3 = config.model_type == "qwen3_omni_moe"
    cls = Qwen3OmniMoeForConditionalGeneration if qwen3 else Qwen2_5OmniForConditionalGeneration
    if DUMMY:
        with torch.device(device):
            hf = cls._from_config(config, dtype=dtype)
        if not qwen3:
            hf.load_speakers(str(Path(model) / "spk_dict.pt"))
    else:
        hf = cls.from_pretrained(model, dtype=dtype).to(device)
    if qwen3:
        from vllm_omni.testing.tiny_qwen3_omni import prepare_reference

        prepare_reference(hf)
    speaker = {"speaker": "Ethan", "thinker_eos_token_id": 151645} if qwen3 else {"speaker": "Chelsie"}
    if DUMMY and not qwen3:
        # Qwen3's generate already suppresses the non-code ids; Qwen2.5's does not (see NUM_CODES).
        vocab = config.talker_config.vocab_size
        speaker["talker_bad_words_ids"] = [[t] for t in range(NUM_CODES, vocab)]
    return hf.eval(), speaker


def bench_hf(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from vllm_omni.entrypoints.cli.bench.backends import RequestResult

    if args.hf_threads is not None:
        torch.set_num_threads(args.hf_threads)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tok = AutoTokenizer.from_pretrained(model)
    hf, family_kwargs = load_hf(model, device, dtype)

    def one(prompt) -> dict[str, float]:
        if "prompt_token_ids" in prompt:
            ids = torch.tensor([prompt["prompt_token_ids"]], device=device)
        else:
            text = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
            ids = tok(text, return_tensors="pt")["input_ids"].to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            _, wav = hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **family_kwargs,
                thinker_max_new_tokens=args.text_tokens, thinker_min_new_tokens=args.text_tokens,
                thinker_do_sample=False, talker_max_new_tokens=args.codec_tokens,
                talker_min_new_tokens=args.codec_tokens, talker_do_sample=False)
        sync(device)
        e2e = time.perf_counter() - t0
        # Not streaming: its first audio is its latency, one chunk of the whole reply.
        return RequestResult(success=True, start=t0, latency=e2e, audio_chunks=[(e2e, wav.numel() / 24000)])

    one(make_prompts(1, args.prompt_words)[0])  # warm-up
    start = time.perf_counter()
    results = [one(p) for p in make_prompts(args.hf_requests, args.prompt_words)]
    row = bench_load.summarize(Run("transformers c=1", len(results), concurrency=1), results,
                               time.perf_counter() - start)
    bench_load.print_rows([row])
    return {"rows": [row], "device": device, "dtype": str(dtype), "threads": torch.get_num_threads()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    args = parse_args()
    if args.log_requests:  # every request's line (log_stats); the slowest ones are printed anyway
        logging.basicConfig(format="%(message)s")
    from vllm_omni.engine.stage_init_utils import prepare_engine_environment

    prepare_engine_environment()  # spawn for the stages, before building a model picks a start method
    global DUMMY, NUM_CODES
    model = args.model
    if args.dummy_config:
        from vllm_omni.testing.dummy_checkpoints import make_dummy_omni_checkpoint

        DUMMY = True
        NUM_CODES = codec_code_count(json.loads(Path(args.dummy_config).read_text()))
        model = str(make_dummy_omni_checkpoint(args.dummy_config, Path(tempfile.mkdtemp()) / "dummy"))
    elif model is None:
        from vllm_omni.testing import make_tiny_model

        model = str(make_tiny_model("qwen2_5_omni", Path(tempfile.mkdtemp()) / "qwen2_5_omni", seed=0))
    runs = plan_runs(args)
    result: dict[str, Any] = {
        "model": args.dummy_config or args.model or "tiny qwen2_5_omni (vllm_omni.testing, seed 0)",
        "text_tokens": args.text_tokens, "codec_tokens": args.codec_tokens, "prompt_words": args.prompt_words,
        "runs": [vars(r) for r in runs], "torch": torch.__version__, "transformers_version": transformers.__version__,
        "host": platform.node(), "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for chunked in ("on", "off"):
        if args.async_chunk not in (chunked, "both"):
            continue
        if args.mode in ("inproc", "both"):
            result[f"ours_async_chunk_{chunked}"] = bench_inproc(model, args, runs, async_chunk=chunked == "on")
        if args.mode in ("http", "both"):
            result[f"http_async_chunk_{chunked}"] = bench_http(model, args, runs, async_chunk=chunked == "on")
        if args.mode == "both":
            result[f"http_vs_inproc_async_chunk_{chunked}"] = [
                bench_load.compare_http(a, b) for a, b in zip(result[f"ours_async_chunk_{chunked}"]["rows"],
                                                              result[f"http_async_chunk_{chunked}"]["rows"])]
    if not args.skip_hf:
        result["transformers"] = bench_hf(model, args)
    bench_load.write_json(args.json, result)
    print_stage_table({name: result[name]["stages"] for name in ("ours_async_chunk_on", "ours_async_chunk_off")
                       if name in result})


if __name__ == "__main__":
    main()
