"""What the end-to-end benchmarks share (bench_tts.py, bench_omni_e2e.py): sustained runs, requests
timed at the client in-process (`AsyncOmni`) or over HTTP (`vllm-omni serve` in a subprocess,
driven by the `vllm bench serve` client in this process), and one set of figures
(vllm_omni/entrypoints/cli/bench/metrics.py: first audio tails, playback underruns, worst gap).

- `Run`: one level, closed loop (at most C in flight) or open loop (Poisson arrivals at R/s);
  `sustain` raises its request count to what sustained load needs (cli/bench/sustained.py).
- `drive`: sends a run's requests on `vllm bench serve`'s schedule (runner.arrival_offsets).
- `summarize`: the first 10% of the requests are warm-up, reported apart; the others give
  first audio p50/p90/p95/p99, e2e, underruns (a chunk arriving after everything before it has
  played, for a listener that starts at the first chunk) and the worst gap.
- `StageLog`: the orchestrator's per-request stage timings (log_stats), printed for the slowest
  requests (`print_timelines`), so that a slow first audio says where it waited.
- `Server`: `vllm-omni serve` with the benchmark's stage overrides, for the HTTP mode.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.cli.bench import metrics
from vllm_omni.entrypoints.cli.bench.backends import RequestResult, Target
from vllm_omni.entrypoints.cli.bench.runner import arrival_offsets
from vllm_omni.entrypoints.cli.bench.sustained import WARMUP_FRACTION, sustained_count, why_short

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    name: str
    num_requests: int
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop: Poisson arrivals per second

    @classmethod
    def closed(cls, concurrency: int, num_requests: int) -> Run:
        return cls(f"c={concurrency}", num_requests, concurrency=concurrency)

    @classmethod
    def poisson(cls, rate: float, num_requests: int) -> Run:
        return cls(f"poisson {rate:g}/s", num_requests, rate=rate)


def serving_process() -> None:
    """This process now serves (its AsyncOmni is up): freeze the start-up heap and log long
    collections, as `vllm-omni serve` does (engine/serving_stalls.py)."""
    from vllm_omni.engine.serving_stalls import freeze_startup_heap, log_long_pauses

    freeze_startup_heap()
    log_long_pauses("benchmark")


def sustain(run: Run, allow_short: bool) -> Run:
    """The run with enough requests for sustained load (unchanged with `allow_short`)."""
    short = why_short(run.num_requests, concurrency=run.concurrency, rate=run.rate)
    if short is None or allow_short:
        if short is not None:
            print(f"{run.name}: not a sustained run ({short}); --allow-short keeps it", flush=True)
        return run
    needed = sustained_count(run.num_requests, concurrency=run.concurrency, rate=run.rate)
    print(f"{run.name}: {short}: sending {needed}", flush=True)
    return replace(run, num_requests=needed)


async def drive(send: Callable[[int], Awaitable[RequestResult]], run: Run, seed: int = 0,
                state: Callable[[], Awaitable[str]] | None = None) -> tuple[list[RequestResult], float]:
    """Request i = send(i), on the schedule of `vllm bench serve` (same arrivals for the same
    rate and seed); (results in send order, seconds from the first send to the last answer).
    `state`: the pipeline's state, printed with each progress line (`pipeline_state`)."""
    offsets = arrival_offsets(run.num_requests, run.rate or math.inf, 1.0, seed)
    gate = asyncio.Semaphore(run.concurrency) if run.concurrency else None
    start = time.perf_counter()
    sent, done = [0], []

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        sent[0] += 1
        if gate is None:
            result = await send(i)
        else:
            async with gate:
                result = await send(i)
        done.append(result)
        return result

    progress = asyncio.ensure_future(_report_progress(run, start, sent, done, state))
    try:
        results = await asyncio.gather(*(one(i) for i in range(run.num_requests)))
    finally:
        progress.cancel()
    return list(results), time.perf_counter() - start


async def _report_progress(run: Run, start: float, sent: list[int], done: list[RequestResult],
                           state: Callable[[], Awaitable[str]] | None) -> None:
    """Every PROGRESS_S while a run lasts: requests sent, done, failed and in flight, and the first
    audio of those done since the last line (a run that falls behind its arrivals shows how), and
    the pipeline's state (a run that stops moving shows where)."""
    reported = 0
    while True:
        await asyncio.sleep(PROGRESS_S)
        recent = [1000 * r.audio_chunks[0][0] for r in done[reported:] if r.audio_chunks]
        reported = len(done)
        firsts = f", first audio of these p50 {sorted(recent)[len(recent) // 2]:.0f} max {max(recent):.0f} ms" \
            if recent else ""
        print(f"  {run.name} +{time.perf_counter() - start:.0f}s: {sent[0]} sent, {len(done)} done "
              f"({sum(not r.success for r in done)} failed), {sent[0] - len(done)} in flight{firsts}", flush=True)
        if state is not None:
            print(f"    {await state()}", flush=True)


async def pipeline_state(engine: Any) -> str:
    """An AsyncOmni's stages on one line: the requests each holds (queued; KV blocks free), asked
    of the stage (no answer within STATS_TIMEOUT_S: the stage's loop is stuck), and the
    orchestrator's counters for it: output tokens and flow-control pauses / resumes so far."""
    from stage_stats import stage_counters  # benchmarks/, beside this module

    parts = []
    for stage, counters in zip(engine.pipeline.stages, stage_counters(engine)):
        try:
            s = await asyncio.wait_for(engine.get_stage_stats(stage.stage_id), STATS_TIMEOUT_S)
            where = " ".join(f"{k} {v}" for k, v in s.counts.items())
            held = f"{s.num_unfinished} held ({where})" + (
                f", {s.kv_free_blocks}/{s.kv_total_blocks} KV blocks free" if s.kv_total_blocks else "")
        except Exception as e:  # noqa: BLE001 - what failed is the report
            held = f"no stats ({type(e).__name__})"
        parts.append(f"{counters['stage']}: {held}, {counters.get('output_tokens', 0)} tokens out, "
                     f"{counters.get('pauses', 0)}/{counters.get('resumes', 0)} pauses/resumes")
    if os.path.isdir("/dev/shm"):  # tensors between stages travel there (a full one stops the writer)
        shm = shutil.disk_usage("/dev/shm")
        parts.append(f"/dev/shm {shm.used / 2**20:.0f} of {shm.total / 2**20:.0f} MiB used")
    return "; ".join(parts)


PROGRESS_S = 10.0
STATS_TIMEOUT_S = 3.0


async def warm_up(send: Callable[[Run], Awaitable[Any]]) -> None:
    """One request alone, then two together, before the measured runs: the first batch shapes of
    both (a first request of a new shape compiles kernels; issue 44: one c=1 request in eight
    waited for that when the warm-up ran only two together)."""
    await send(Run("warm-up 1", 1, concurrency=1))
    await send(Run("warm-up 2", 2, concurrency=2))


async def inproc_request(engine: Any, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> RequestResult:
    """One request through AsyncOmni, streamed, timed as the HTTP client times it (arrival of each
    text delta and audio chunk)."""
    result = RequestResult(start=time.perf_counter())
    rate = None
    try:
        async for out in engine.generate(prompt, params, request_id=request_id, output_partial=True, **kwargs):
            now = time.perf_counter() - result.start
            delta = out.delta
            if out.final_output_type == "text" and delta.token_ids:
                result.ttft = now if result.ttft is None else result.ttft
                if result.text_latency:
                    result.itl.append(now - result.text_latency)
                result.text_latency = now
                result.output_tokens += len(delta.token_ids)
            elif out.final_output_type == "audio":
                mm = delta.multimodal_output
                rate = int(mm["sample_rate"]) if "sample_rate" in mm else rate
                if "audio" in mm and mm["audio"].numel():
                    result.audio_chunks.append((now, mm["audio"].numel() / (rate or 24000)))
        result.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - result.start
    return result


def summarize(run: Run, results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """One level's figures: throughput over every request; latencies over the measured ones
    (after the warm-up: the first 10%, rounded up)."""
    warm = metrics.warmup_count(len(results), WARMUP_FRACTION)
    measured, warmup = results[warm:], results[:warm]
    run_all = metrics.run_metrics(results, duration)
    run_measured = metrics.run_metrics(measured, duration)

    def tails(metric: str, rs: Sequence[RequestResult]) -> dict[str, float] | None:
        s = metrics.Summary.of(metrics.samples(rs, metric), (50, 90, 95, 99))
        if s is None:
            return None
        return {"mean": s.mean, "max": s.max, **{f"p{p:g}": v for p, v in s.percentiles}}

    first = min((r.start for r in results), default=0.0)
    plays = [metrics.playback(r.audio_chunks) for r in results]
    return {
        "run": run.name, "requests": len(results), "warmup": warm, "failed": run_all.failed,
        "concurrency": run.concurrency, "rate": run.rate, "duration_s": duration,
        "requests_per_s": run_all.request_throughput, "audio_s_per_s": run_all.audio_throughput,
        "peak_in_flight": run_all.peak_concurrency,
        "ttfa_ms": tails("audio_ttfp", measured), "ttft_ms": tails("ttft", measured), "e2e_ms": tails("e2el", measured),
        "rtf": tails("audio_rtf", measured), "warmup_ttfa_ms": tails("audio_ttfp", warmup),
        "underruns": run_measured.underruns, "requests_with_underruns": run_measured.requests_with_underruns,
        "worst_gap_ms": 1000 * run_measured.worst_gap, "warmup_underruns": run_all.underruns - run_measured.underruns,
        "underruns_by_chunk": late_by_chunk(plays[warm:]),
        "each": [{"i": i, "start_s": r.start - first, "ttft_ms": _ms(r.ttft), "ttfa_ms": _ms(r.audio_chunks[0][0])
                  if r.audio_chunks else None, "e2e_ms": _ms(r.latency), "chunks": len(r.audio_chunks),
                  "audio_s": r.audio_seconds, "underruns": play.underruns,
                  "late_chunks": [[index, round(1000 * gap, 1)] for index, gap in play.late],
                  "error": r.error or None} for i, (r, play) in enumerate(zip(results, plays))],
    }


def late_by_chunk(plays: Sequence[metrics.Playback]) -> dict[str, dict[str, float]]:
    """Underruns by the index of the chunk that came late (1: the second chunk, the ramp's first
    join): {index: {"count", "worst_gap_ms"}}, which says whether a ramp or steady chunks run dry."""
    out: dict[str, dict[str, float]] = {}
    for play in plays:
        for index, gap in play.late:
            entry = out.setdefault(str(index), {"count": 0, "worst_gap_ms": 0.0})
            entry["count"] += 1
            entry["worst_gap_ms"] = round(max(entry["worst_gap_ms"], 1000 * gap), 1)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def print_rows(rows: Sequence[dict[str, Any]], title: str = "") -> None:
    def f(d: dict | None, key: str) -> str:
        return "-" if d is None or d.get(key) is None else f"{d[key]:.1f}"

    print(f"\n{title}{'run':<18}{'reqs':>6}{'warm':>5}{'fail':>5}{'TTFA p50':>9}{'p90':>8}{'p95':>8}{'p99':>8}"
          f"{'e2e p50':>9}{'RTF p50':>8}{'req/s':>7}{'aud s/s':>8}{'under':>6}{'gap ms':>8}{'warm TTFA':>10}")
    for r in rows:
        rtf = "-" if r["rtf"] is None else f"{r['rtf']['p50']:.3f}"
        print(f"{r['run']:<18}{r['requests']:>6}{r['warmup']:>5}{r['failed']:>5}{f(r['ttfa_ms'], 'p50'):>9}"
              f"{f(r['ttfa_ms'], 'p90'):>8}{f(r['ttfa_ms'], 'p95'):>8}{f(r['ttfa_ms'], 'p99'):>8}"
              f"{f(r['e2e_ms'], 'p50'):>9}{rtf:>8}"
              f"{r['requests_per_s']:>7.2f}{r['audio_s_per_s']:>8.1f}{r['underruns']:>6}{r['worst_gap_ms']:>8.1f}"
              f"{f(r['warmup_ttfa_ms'], 'max'):>10}", flush=True)


def measure(runs: Sequence[Run], run_one: Callable[[Run], tuple[list[RequestResult], float]], title: str,
            request_id: Callable[[Run, int], str] | None = None, stage_log: StageLog | None = None,
            save: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """Each run in turn, its figures printed and `save`d as soon as it ends (a run cut short by a
    time limit leaves the ones before it)."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        row = summarize(run, *run_one(run))
        rows.append(row)
        print_rows([row], title=f"[{title}] ")
        print_timelines(row, (lambda i, run=run: request_id(run, i)) if request_id else str, stage_log)
        save(rows)
    return rows


class StageLog(logging.Handler):
    """Keeps the orchestrator's per-request stage timings (its log_stats lines), by request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("request ") and ": e2e " in message:
            self.lines[message[len("request "):].split(":", 1)[0]] = message

    @classmethod
    def install(cls) -> StageLog:
        handler = cls()
        log = logging.getLogger("vllm_omni.engine.orchestrator")
        log.setLevel(logging.INFO)
        log.addHandler(handler)
        # With a handler in the chain, Python's last-resort one no longer prints the orchestrator's
        # warnings and errors (a failed request, a stage gone): this process's stderr gets them.
        root = logging.getLogger()
        if not root.handlers:
            stderr = logging.StreamHandler()
            stderr.setLevel(logging.WARNING)
            stderr.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            root.addHandler(stderr)
        return handler


def print_timelines(row: dict[str, Any], request_id: Callable[[int], str], stage_log: StageLog | None,
                    slowest: int = 3) -> None:
    """Each request's first audio in send order on one line (the slow ones stand out, periodic or
    not), then the slowest requests' stage timings."""
    each = row["each"]
    firsts = " ".join("-" if e["ttfa_ms"] is None else f"{e['ttfa_ms']:.0f}" for e in each)
    print(f"  {row['run']}: first audio ms in send order: {firsts}")
    if row.get("underruns_by_chunk"):
        late = ", ".join(f"{index}: {v['count']} (worst {v['worst_gap_ms']:.0f} ms)"
                         for index, v in row["underruns_by_chunk"].items())
        print(f"  {row['run']}: underruns by chunk index (0: the first): {late}")
    timed = sorted((e for e in each if e["ttfa_ms"] is not None), key=lambda e: -e["ttfa_ms"])[:slowest]
    for e in timed:
        stages = stage_log.lines.get(request_id(e["i"]), "") if stage_log is not None else ""
        print(f"    request {e['i']} sent at +{e['start_s']:.3f}s: first audio {e['ttfa_ms']:.1f} ms, e2e "
              f"{e['e2e_ms']:.1f} ms, {e['chunks']} chunks, {e['underruns']} underruns" + (f"\n      {stages}" if stages
                                                                                               else ""))


class Server:
    """`vllm-omni serve MODEL` in a subprocess (its own process group) for the HTTP mode."""

    def __init__(self, model: str, args: Sequence[str], log_path: Path, start_timeout_s: float = 900.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", "bench", "--uvicorn-log-level", "warning", *args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(start_timeout_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the server was not healthy within {timeout_s} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def target(self, endpoint: str, extra_body: dict[str, Any] | None = None) -> Target:
        return Target(url=self.url + endpoint, model="bench", headers={}, extra_body=extra_body or {},
                      ignore_eos=False, sample_rate=24000)


def compare_http(inproc: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """The HTTP path's cost on first audio: the same run in-process and through the server."""
    def p50(row: dict[str, Any]) -> float | None:
        return (row.get("ttfa_ms") or {}).get("p50")

    a, b = p50(inproc), p50(http)
    if a is None or b is None:
        print(f"\nHTTP vs AsyncOmni, {inproc['run']}: no first audio to compare", flush=True)
        return {"run": inproc["run"], "inproc_ttfa_p50_ms": a, "http_ttfa_p50_ms": b, "http_overhead_ms": None}
    delta = b - a
    print(f"\nHTTP vs AsyncOmni, {inproc['run']}: first audio p50 {a:.1f} ms in-process, {b:.1f} ms over HTTP: "
          f"{delta:+.1f} ms (target <= +5 ms)", flush=True)
    return {"run": inproc["run"], "inproc_ttfa_p50_ms": a, "http_ttfa_p50_ms": b, "http_overhead_ms": delta}


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))
