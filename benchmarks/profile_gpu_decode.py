"""Where a decode step's GPU time goes: per-kernel CUDA time of one eager decode step
(kernel durations are the same inside the CUDA graph), grouped by kernel name, with the
byte floor of each GEMM. Random bf16 weights of the given architecture.

    python benchmarks/profile_gpu_decode.py --config benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json --batch 1
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HBM_BYTES_PER_S = 4.27e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", default="profile_decode.json")
    args = p.parse_args()
    from vllm_omni import SamplingParams
    from vllm_omni.entrypoints.llm import LLM

    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(Path(args.config).read_text())
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              max_num_seqs=max(8, args.batch), enforce_eager=True, gpu_memory_utilization=0.5)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    for i in range(args.batch):
        engine.add_request(str(i), list(range(100, 100 + args.context)), params)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm-up decode
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name[:90]].append(evt.device_time)
    rows = sorted(((sum(v), len(v), k) for k, v in totals.items()), reverse=True)
    total_us = sum(r[0] for r in rows)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(f"batch {args.batch}: {sum(r[1] for r in rows)} kernels, {total_us / 1e3:.2f} ms of kernel time; "
          f"weight floor {weight_bytes / HBM_BYTES_PER_S * 1e3:.2f} ms")
    print(f"{'us total':>10}{'count':>7}{'us each':>9}  kernel")
    for us, n, name in rows[:25]:
        print(f"{us:>10.0f}{n:>7}{us / n:>9.1f}  {name}")
    Path(args.json).write_text(json.dumps([{"us": r[0], "count": r[1], "name": r[2]} for r in rows], indent=1))


if __name__ == "__main__":
    main()
