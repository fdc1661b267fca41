"""End to end Qwen2.5-Omni (thinker -> talker -> code2wav): our pipeline vs transformers.

Each request is a chat prompt; the reply has a fixed length (EOS ignored): `--text-tokens`
thinker tokens, `--codec-tokens` talker codes, greedy, code2wav with its default 10 ODE steps.
Ours runs through `AsyncOmni` (real stage processes) with at most C requests in flight for
each C in `--concurrency`, streaming (output_partial) to time the first text token. transformers
runs `Qwen2_5OmniForConditionalGeneration.generate` one request at a time in this process.

Ours runs twice in the same run by default (`--async-chunk both`): with streaming edges
(async_chunk: the talker starts on the thinker's first tokens, code2wav on the talker's first
codes) and without (each stage hands its finished output to the next).

Reported per engine and concurrency: e2e latency (mean / p50 / p90), TTFT (first text token),
time to first audio (p50 / p90), RTF = generation seconds / audio seconds (per request, and
the aggregate wall time / audio seconds), requests/s, the gaps between a request's audio
chunks (p50 / p99) and playback underruns (a chunk arriving after everything before it has
played, for a client that starts playing at the first chunk). Per stage (the orchestrator's
counters): requests, tokens, busy time, early starts over streaming edges, flow-control pauses.

    python benchmarks/bench_omni_e2e.py                                # tiny random checkpoint, CPU
    python benchmarks/bench_omni_e2e.py --model DIR --concurrency 1,8,32 --num-requests 64 --skip-hf
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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from stage_stats import print_stage_table, stage_counters  # benchmarks/ (the script's folder)

WORDS = ("river mountain city music light garden ocean story morning window paper bridge voice "
         "forest winter market dream silver orange travel").split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen2.5-Omni checkpoint directory (default: build the tiny one)")
    p.add_argument("--dummy-config", help="real config.json: random weights of that architecture (GPU)")
    p.add_argument("--concurrency", default="1,4", help="comma-separated in-flight request limits")
    p.add_argument("--num-requests", type=int, default=8, help="requests per concurrency level (at least C)")
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
                   help="log each request's stage timings (when each stage got it, its first output)")
    p.add_argument("--json", default="bench_omni_e2e.json")
    return p.parse_args()


DUMMY = False  # set from --dummy-config: prompts become real-vocabulary token ids
# With random weights and EOS ignored a talker also samples its special ids, which no vocoder
# decodes: with --dummy-config the talker may only sample real codes [0, NUM_CODES).
NUM_CODES: int | None = None


def make_prompts(n: int, words: int) -> list[dict[str, Any]]:
    if DUMMY:
        from vllm_omni.testing.dummy_checkpoints import chat_prompt_ids

        return [{"prompt_token_ids": chat_prompt_ids(words, seed=i)} for i in range(n)]
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(n):
        picks = torch.randint(0, len(WORDS), (words,), generator=g).tolist()
        text = "Tell me about " + " ".join(WORDS[i] for i in picks) + "."
        prompts.append({"messages": [{"role": "user", "content": text}]})
    return prompts


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


def summarize(rows: list[dict[str, float]], wall: float) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float] | None:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        if not values:
            return None
        return {"mean": statistics.fmean(values), "p50": values[len(values) // 2],
                "p90": values[min(len(values) - 1, int(0.9 * len(values)))]}

    audio = sum(r["audio_s"] for r in rows)
    gaps = sorted(g for r in rows for g in r.get("gaps_s", []))
    return {"requests": len(rows), "wall_s": wall, "requests_per_s": len(rows) / wall, "audio_s": audio,
            "e2e_s": stats("e2e_s"), "ttft_s": stats("ttft_s"), "ttfa_s": stats("ttfa_s"),
            "rtf": stats("rtf"), "rtf_aggregate": wall / audio if audio else None,
            "gap_p50_s": gaps[len(gaps) // 2] if gaps else None,
            "gap_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            "underruns": sum(r.get("underruns", 0) for r in rows),
            # Each request's start on time.perf_counter() (the stage profiler's clock) and its times.
            "each": [{k: r.get(k) for k in ("start_s", "ttft_s", "ttfa_s", "e2e_s", "underruns", "gaps_s")}
                     for r in rows]}


# ----------------------------------------------------------------------------------------- ours


async def _one(omni, prompt, params) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    chunks: list[tuple[float, float]] = []  # (arrival, seconds of audio) per audio chunk
    rate = None
    async for out in omni.generate(prompt, params, output_partial=True):
        now = time.perf_counter() - t0
        if out.final_output_type == "text" and ttft is None and out.delta.token_ids:
            ttft = now
        if out.final_output_type == "audio":
            mm = out.delta.multimodal_output
            rate = int(mm["sample_rate"]) if "sample_rate" in mm else rate
            if "audio" in mm and mm["audio"].numel():
                chunks.append((now, mm["audio"].numel() / (rate or 24000)))
    e2e = time.perf_counter() - t0
    audio_s = sum(d for _, d in chunks)
    # Playback starts at the first chunk; chunk i underruns if it arrives after all before it played.
    underruns, played_until = 0, None
    for arrival, duration in chunks:
        if played_until is not None and arrival > played_until:
            underruns += 1
        played_until = max(played_until or arrival, arrival) + duration
    return {"start_s": t0, "e2e_s": e2e, "ttft_s": ttft, "ttfa_s": chunks[0][0] if chunks else None,
            "audio_s": audio_s, "rtf": e2e / audio_s if audio_s else None, "underruns": underruns,
            "gaps_s": [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]}


async def _level(omni, prompts, params, concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with gate:
            return await _one(omni, prompt, params)

    start = time.perf_counter()
    rows = await asyncio.gather(*(limited(p) for p in prompts))
    return summarize(rows, time.perf_counter() - start)


def bench_ours(model: str, args: argparse.Namespace, levels: list[int], async_chunk: bool) -> dict[str, Any]:
    from vllm_omni import AsyncOmni

    overrides = args.stage_overrides or {str(s): {"max_num_seqs": max(levels)} for s in range(3)}
    if DUMMY:
        for stage, values in overrides.items():
            values["load_format"] = "dummy"
            if stage in ("0", "1"):  # the AR stages: CUDA graphs and bf16
                values.update(enforce_eager=False, dtype="bfloat16")
    engine_args = {"dtype": args.dtype} if args.dtype else {}
    t0 = time.perf_counter()
    omni = AsyncOmni(model, stage_configs_path=args.stage_configs_path, deploy_config=args.deploy_config,
                     stage_overrides=overrides, async_chunk=async_chunk, log_stats=True, **engine_args)
    startup = time.perf_counter() - t0
    params = fixed_length_params(args)
    try:
        async def run() -> dict[str, Any]:
            await _level(omni, make_prompts(2, args.prompt_words), params, 2)  # warm-up
            return {str(c): await _level(omni, make_prompts(max(c, args.num_requests), args.prompt_words), params, c)
                    for c in levels}
        results = asyncio.run(run())
        stages = stage_counters(omni)
    finally:
        omni.close()
    return {"startup_s": startup, "async_chunk": async_chunk, "by_concurrency": results, "stages": stages}


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
        audio_s = wav.numel() / 24000
        return {"e2e_s": e2e, "ttft_s": None, "ttfa_s": e2e, "audio_s": audio_s, "rtf": e2e / audio_s}

    one(make_prompts(1, args.prompt_words)[0])  # warm-up
    start = time.perf_counter()
    rows = [one(p) for p in make_prompts(args.hf_requests, args.prompt_words)]
    return {"by_concurrency": {"1": summarize(rows, time.perf_counter() - start)}, "device": device,
            "dtype": str(dtype), "threads": torch.get_num_threads()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ main


def fmt(value: dict[str, float] | float | None, key: str | None = None) -> str:
    if isinstance(value, dict):
        value = value[key]
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    args = parse_args()
    if args.log_requests:  # the orchestrator's per-request line (log_stats)
        logging.basicConfig(format="%(message)s")
        logging.getLogger("vllm_omni.engine.orchestrator").setLevel(logging.INFO)
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
    levels = [int(c) for c in args.concurrency.split(",")]
    result: dict[str, Any] = {
        "model": args.dummy_config or args.model or "tiny qwen2_5_omni (vllm_omni.testing, seed 0)",
        "text_tokens": args.text_tokens, "codec_tokens": args.codec_tokens, "prompt_words": args.prompt_words,
        "torch": torch.__version__, "transformers_version": transformers.__version__, "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for mode in ("on", "off"):
        if args.async_chunk in (mode, "both"):
            result[f"ours_async_chunk_{mode}"] = bench_ours(model, args, levels, async_chunk=mode == "on")
    if not args.skip_hf:
        result["transformers"] = bench_hf(model, args)
    Path(args.json).write_text(json.dumps(result, indent=2))
    names = ("ours_async_chunk_on", "ours_async_chunk_off", "transformers")
    print(f"{'engine':<22}{'conc':>5}{'reqs':>6}{'e2e mean':>10}{'e2e p90':>9}{'TTFT':>8}{'TTFA p50':>9}"
          f"{'TTFA p90':>9}{'RTF':>8}{'RTF agg':>9}{'req/s':>8}{'gap p50':>9}{'gap p99':>9}{'underrun':>9}")
    for name in names:
        for conc, r in result.get(name, {}).get("by_concurrency", {}).items():
            print(f"{name:<22}{conc:>5}{r['requests']:>6}{fmt(r['e2e_s'], 'mean'):>10}{fmt(r['e2e_s'], 'p90'):>9}"
                  f"{fmt(r['ttft_s'], 'p50'):>8}{fmt(r['ttfa_s'], 'p50'):>9}{fmt(r['ttfa_s'], 'p90'):>9}"
                  f"{fmt(r['rtf'], 'mean'):>8}{fmt(r['rtf_aggregate']):>9}{r['requests_per_s']:>8.2f}"
                  f"{fmt(r.get('gap_p50_s')):>9}{fmt(r.get('gap_p99_s')):>9}{r.get('underruns', 0):>9}")
    print_stage_table({name: result[name]["stages"] for name in names[:2] if name in result})


if __name__ == "__main__":
    main()
