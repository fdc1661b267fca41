"""The flags of `bench serve`: upstream vLLM-Omni's (vLLM's `bench serve` plus its omni backends
and random-mm dataset), with this client's additions marked."""
from __future__ import annotations

import argparse
import json
import os

from vllm_omni.entrypoints.cli.bench.backends import BACKENDS, DEFAULT_ENDPOINTS
from vllm_omni.entrypoints.cli.bench.datasets import DATASETS, parse_buckets
from vllm_omni.entrypoints.cli.bench.metrics import METRICS


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--omni", action="store_true", help="upstream's switch for the omni backends (accepted; "
                                                       "every backend is available)")
    p.add_argument("--backend", choices=BACKENDS, default="openai-chat-omni", help="request shape")
    p.add_argument("--base-url", default=None, help="server URL, e.g. http://host:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="path (default: the backend's, e.g. /v1/chat/completions)")
    p.add_argument("--model", default=None, help="model name sent (default: the server's first /v1/models entry); "
                                                 "a local folder also gives the tokenizer")
    p.add_argument("--served-model-name", default=None, help="name sent instead of --model")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder: exact token counts for random prompts")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: "
                                                                                "$OPENAI_API_KEY)")
    p.add_argument("--header", action="append", default=None, metavar="KEY=VALUE", help="extra HTTP header")
    p.add_argument("--extra-body", "--extra_body", dest="extra_body", default=None,
                   help="JSON object merged into every request body, e.g. '{\"modalities\": [\"text\"]}'")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON (sharegpt) or JSON lines (custom)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el,audio_ttfp,audio_rtf",
                   help=f"metrics with percentiles: {', '.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="50,90,95,99", help="percentiles to report (upstream's "
                                                                       "default is 99; tails here)")
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="[this client] the first requests sent, "
                   "as a fraction of --num-prompts (rounded up), reported apart from the latency figures")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="include every request's timings")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--disable-tqdm", action="store_true", help="accepted: this client shows no progress bar")
    p.add_argument("--audio-sample-rate", type=int, default=24000, help="[this client] rate of the raw PCM the "
                                                                        "speech backend receives")
    g = p.add_argument_group("random / random-mm datasets")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    g.add_argument("--random-mm-limit-mm-per-prompt", default='{"image": 1, "audio": 1}')
    g.add_argument("--random-mm-bucket-config", default="{(256, 256, 1): 1.0}",
                   help="{(height, width, frames): probability}; (0, 1, seconds) is audio")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="max_tokens of sharegpt/custom prompts")


def check_serve_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the flags (after filling the defaults that depend on others)."""
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    if args.num_prompts < 1:
        return "--num-prompts must be >= 1"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    if not 0.0 <= args.warmup_fraction < 1.0:
        return "--warmup-fraction must be in [0, 1)"
    if not 0.0 <= args.random_range_ratio < 1.0:
        return "--random-range-ratio must be in [0, 1)"
    unknown = [m for m in args.percentile_metrics.split(",") if m.strip() and m.strip() not in METRICS]
    if unknown:
        return f"--percentile-metrics: unknown {unknown}; allowed: {', '.join(METRICS)}"
    try:
        if any(not 0 < float(p) <= 100 for p in args.metric_percentiles.split(",") if p.strip()):
            return "--metric-percentiles must be numbers in (0, 100]"
        if args.extra_body is not None and not isinstance(json.loads(args.extra_body), dict):
            return "--extra-body must be a JSON object"
        if args.dataset_name == "random-mm":
            parse_buckets(args.random_mm_bucket_config)
            json.loads(args.random_mm_limit_mm_per_prompt)
    except (ValueError, SyntaxError) as exc:
        return f"bad value: {exc}"
    if any("=" not in h for h in args.header or ()):
        return "--header takes KEY=VALUE"
    if args.model is None:
        args.model = _first_served_model(args.base_url, args.api_key)
        if args.model is None:
            return f"no --model given and {args.base_url}/v1/models names none"
    return None


def _first_served_model(base_url: str, api_key: str | None) -> str | None:
    import httpx

    try:
        r = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return None
    return data[0].get("id") if data else None
