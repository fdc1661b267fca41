"""How a run is shown (upstream vLLM-Omni's layout: 40-column labels, one section per kind of
output) and saved (`--save-result`: one JSON file)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.cli.bench.backends import RequestResult
from vllm_omni.entrypoints.cli.bench.metrics import METRICS, RunMetrics, Summary, samples

TEXT_METRICS = ("ttft", "tpot", "itl")


def _line(label: str, value: Any) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^50}"


def summaries(results: Sequence[RequestResult], metrics: Sequence[str],
              percentiles: Sequence[float]) -> dict[str, Summary | None]:
    return {m: Summary.of(samples(results, m), percentiles) for m in metrics}


def _metric_lines(metric: str, summary: Summary | None) -> list[str]:
    if summary is None:
        return []
    header, unit = METRICS[metric]
    name = metric.upper() + (f" ({unit})" if unit else "")
    lines = [_title(header, "-"), _line(f"Mean {name}:", summary.mean), _line(f"Median {name}:", summary.median)]
    for p, value in summary.percentiles:
        lines.append(_line(f"P{p:g} {name}:", value))
    return lines


def render(run: RunMetrics, measured: dict[str, Summary | None], warmup: dict[str, Summary | None],
           num_warmup: int, max_concurrency: int | None, request_rate: float) -> str:
    lines = [_title(" Serving Benchmark Result ", "="), _line("Successful requests:", run.completed),
             _line("Failed requests:", run.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    lines += [_line("Benchmark duration (s):", run.duration), _line("Request throughput (req/s):",
                                                                     run.request_throughput),
              _line("Peak concurrent requests:", float(run.peak_concurrency))]
    lines += _metric_lines("e2el", measured.get("e2el"))
    if run.total_output:
        lines += [_title(" Text Result ", "="), _line("Total input tokens:", run.total_input),
                  _line("Total generated tokens:", run.total_output),
                  _line("Output token throughput (tok/s):", run.output_throughput),
                  _line("Total Token throughput (tok/s):",
                        (run.total_input + run.total_output) / run.duration if run.duration else 0.0)]
        for metric in TEXT_METRICS:
            lines += _metric_lines(metric, measured.get(metric))
    if run.audio_seconds:
        lines += [_title(" Audio Result ", "="), _line("Total audio duration generated(s):", run.audio_seconds),
                  _line("Audio throughput(audio duration/s):", run.audio_throughput),
                  _line("Playback underruns:", run.underruns),
                  _line("Requests with underruns:", run.requests_with_underruns),
                  _line("Worst playback gap (ms):", run.worst_gap * 1000.0)]
        for metric in (m for m in measured if m.startswith("audio")):
            lines += _metric_lines(metric, measured[metric])
    if num_warmup:
        lines.append(_title(f" Warm-up (first {num_warmup} requests) ", "="))
        for metric, summary in warmup.items():
            if summary is not None:
                header, unit = METRICS[metric]
                lines.append(_line(f"Mean / max {metric.upper()}" + (f" ({unit})" if unit else "") + ":",
                                   f"{summary.mean:.2f} / {summary.max:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)


def save(path: Path, args: Any, run: RunMetrics, measured: dict[str, Summary | None],
         warmup: dict[str, Summary | None], results: Sequence[RequestResult], num_warmup: int) -> None:
    data: dict[str, Any] = {
        "backend": args.backend, "model": args.model, "endpoint": args.endpoint, "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts, "request_rate": str(args.request_rate),
        "max_concurrency": args.max_concurrency, "num_warmup": num_warmup, **asdict(run),
        "request_throughput": run.request_throughput, "output_throughput": run.output_throughput,
        "audio_throughput": run.audio_throughput,
        "metrics": {m: asdict(s) for m, s in measured.items() if s is not None},
        "warmup_metrics": {m: asdict(s) for m, s in warmup.items() if s is not None},
    }
    if args.save_detailed:
        data["requests"] = [{**asdict(r), "audio_chunks": [list(c) for c in r.audio_chunks]} for r in results]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
