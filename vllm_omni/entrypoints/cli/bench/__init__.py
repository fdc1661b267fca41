"""`vllm-omni bench serve` / `vllm bench serve --omni`: upstream's benchmark client, driving any
OpenAI-compatible server over HTTP (ours, upstream's, vLLM's).

    vllm bench serve --omni --backend openai-chat-omni --base-url http://host:8000 \\
        --model Qwen/Qwen3-Omni-30B-A3B-Instruct --dataset-name random --num-prompts 100 \\
        --request-rate 4 --max-concurrency 16 --percentile-metrics ttft,itl,e2el,audio_ttfp

Flags are upstream's (vLLM's `bench serve` plus the omni backends); the printed figures are
upstream's, with tails (`--metric-percentiles`, default 50,90,95,99), the warm-up requests
summarised apart (`--warmup-fraction`), and playback underruns and the worst gap of streamed
audio (metrics.py). docs/compatibility.md ("Benchmark client") has the details.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

from vllm_omni.entrypoints.cli.bench.args import add_serve_arguments, check_serve_arguments


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a running server (`bench serve`)")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser("serve", help="benchmark an OpenAI-compatible server over HTTP",
                                description=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)


def run(args: argparse.Namespace) -> int:
    from vllm_omni.entrypoints.cli.bench import metrics, report, runner
    from vllm_omni.entrypoints.cli.bench.backends import Target
    from vllm_omni.entrypoints.cli.bench.datasets import load_tokenizer, sample_requests
    from vllm_omni.entrypoints.cli.bench.sustained import why_short

    if problem := check_serve_arguments(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        samples = sample_requests(args, load_tokenizer(args.tokenizer or args.model))
    except (OSError, ValueError, KeyError, SyntaxError) as exc:
        print(f"error: cannot build the prompts: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    headers.update(dict(h.split("=", 1) for h in args.header or ()))
    target = Target(url=args.base_url.rstrip("/") + args.endpoint, model=args.served_model_name or args.model,
                    headers=headers, extra_body=json.loads(args.extra_body) if args.extra_body else {},
                    ignore_eos=args.ignore_eos, sample_rate=args.audio_sample_rate)
    print(f"Benchmarking {target.url} ({args.backend}): {len(samples)} requests, rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency}")
    if short := why_short(len(samples), concurrency=args.max_concurrency, rate=args.request_rate):
        print(f"note: not a sustained run ({short}); the figures mostly show a start and a drain")
    results, duration = asyncio.run(runner.run(args.backend, target, samples, rate=args.request_rate,
                                               burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                                               seed=args.seed, timeout_s=args.request_timeout))
    num_warmup = metrics.warmup_count(len(results), args.warmup_fraction)
    wanted = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    run_metrics = metrics.run_metrics(results, duration)
    measured = report.summaries(results[num_warmup:], wanted, percentiles)
    warmup = report.summaries(results[:num_warmup], wanted, percentiles)
    print(report.render(run_metrics, measured, warmup, num_warmup, args.max_concurrency, args.request_rate))
    for failure in [r.error for r in results if not r.success][:3]:
        print(f"failed request: {failure}", file=sys.stderr)
    if args.save_result:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = args.result_filename or f"{args.backend}-{args.request_rate}qps-{Path(args.model).name}-{stamp}.json"
        path = Path(args.result_dir or ".") / name
        report.save(path, args, run_metrics, measured, warmup, results, num_warmup)
        print(f"results saved to {path}")
    return 0 if run_metrics.completed else 1
