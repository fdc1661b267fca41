"""Stage replicas and load balancing, end to end through AsyncOmni (real stage processes).

1. Throughput: the same load (N speech requests, at most C in flight, fixed lengths: EOS
   ignored) on 1 talker replica, then on 2; reported as requests/s and their ratio.
2. Policies: 2 talker replicas, replica 1 slowed on purpose (it sleeps --slow-step-s before
   each engine step: vllm_omni.testing.slow_replica), the same load under each
   --omni-lb-policy; reported as p50 / p90 end-to-end latency and how many requests each
   replica took.

    python benchmarks/bench_replicas.py                      # tiny random Qwen2.5-Omni, CPU
    python benchmarks/bench_replicas.py --model DIR --num-requests 64 --concurrency 16

Every configuration starts its own pipeline; the numbers of one run are comparable with each
other (same machine, same load), not across machines.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_omni.engine.load_balancer import LB_POLICIES

TALKER = "1"
SLOW_WORKER = "vllm_omni.testing.slow_replica.SlowARWorker"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen2.5-Omni checkpoint directory (default: build the tiny one)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--text-tokens", type=int, default=4)
    p.add_argument("--codec-tokens", type=int, default=64)
    p.add_argument("--slow-step-s", type=float, default=0.05, help="the slowed replica's sleep per engine step")
    p.add_argument("--policies", default=",".join(LB_POLICIES), help="comma-separated --omni-lb-policy values")
    p.add_argument("--json", default="bench_replicas.json")
    p.add_argument("--other-stages-in-threads", action="store_true",
                   help="run the thinker and code2wav as threads (runtime.process: false), the talker "
                        "replicas alone as processes: what the test suite's smoke run uses")
    return p.parse_args(argv)


def params(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"temperature": 0.0, "max_tokens": args.text_tokens, "ignore_eos": True},
            {"temperature": 0.0, "max_tokens": args.codec_tokens, "ignore_eos": True}, {"seed": 0}]


def talker_overrides(args: argparse.Namespace, replicas: int, slow_step_s: float | None = None) -> dict[str, Any]:
    # The bundled config puts the talker on device 1; two replicas list two devices (spec 002
    # pool mode; on the CPU they are only names).
    talker: dict[str, Any] = {"max_num_seqs": 32}
    if replicas > 1:
        talker.update(num_replicas=replicas, devices=",".join(str(1 + r) for r in range(replicas)))
    if slow_step_s is not None:
        talker.update(worker_cls=SLOW_WORKER,
                      env={"VLLM_OMNI_SLOW_REPLICAS": "1", "VLLM_OMNI_SLOW_STEP_S": str(slow_step_s)})
    others = {"0": {"process": False}, "2": {"process": False}} if args.other_stages_in_threads else {}
    return {**others, TALKER: talker}


async def _load(omni: Any, args: argparse.Namespace) -> tuple[list[float], float]:
    gate = asyncio.Semaphore(args.concurrency)
    stage_params = params(args)

    async def one(i: int) -> float:
        async with gate:
            t0 = time.perf_counter()
            prompt = {"prompt_token_ids": [10 + (i * 7 + k) % 80 for k in range(8 + i % 5)]}
            async for out in omni.generate(prompt, stage_params, request_id=f"bench-{i}"):
                if out.request_output.error:
                    raise RuntimeError(f"request {i} failed: {out.request_output.error}")
            return time.perf_counter() - t0

    t0 = time.perf_counter()
    latencies = await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    return list(latencies), time.perf_counter() - t0


def run(model: str, args: argparse.Namespace, overrides: dict[str, Any], policy: str) -> dict[str, Any]:
    from vllm_omni import AsyncOmni

    omni = AsyncOmni(model=model, stage_overrides=overrides, lb_policy=policy, async_chunk=False)
    try:
        asyncio.run(_load(omni, argparse.Namespace(**{**vars(args), "num_requests": 2})))  # warm up
        routed_before = [r.routed for r in omni.stage_health()[int(TALKER)].replicas]
        latencies, wall = asyncio.run(_load(omni, args))
        routed = [r.routed - b for r, b in zip(omni.stage_health()[int(TALKER)].replicas, routed_before)]
    finally:
        omni.close()
    ordered = sorted(latencies)
    return {"policy": policy, "talker_replicas": len(routed), "requests": len(latencies), "wall_s": wall,
            "requests_per_s": len(latencies) / wall, "p50_s": statistics.median(ordered),
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "routed_per_replica": routed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from vllm_omni.testing.tiny_models import make_tiny_model

            model = str(make_tiny_model("qwen2_5_omni", Path(tmp) / "tiny-omni"))
        one = run(model, args, talker_overrides(args, 1), "round-robin")
        two = run(model, args, talker_overrides(args, 2), "round-robin")
        slowed = [run(model, args, talker_overrides(args, 2, args.slow_step_s), policy)
                  for policy in args.policies.split(",")]
    result = {"machine": platform.platform(), "args": vars(args),
              "throughput": {"one_replica": one, "two_replicas": two,
                             "ratio": two["requests_per_s"] / one["requests_per_s"]},
              "slow_replica": slowed}
    print(f"requests/s: 1 talker replica {one['requests_per_s']:.2f}, 2 replicas {two['requests_per_s']:.2f} "
          f"(ratio {result['throughput']['ratio']:.2f})")
    for row in slowed:
        print(f"replica 1 slowed by {args.slow_step_s}s/step, {row['policy']:>18}: p50 {row['p50_s']:.2f}s "
              f"p90 {row['p90_s']:.2f}s, requests per replica {row['routed_per_replica']}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
