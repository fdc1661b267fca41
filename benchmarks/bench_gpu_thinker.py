"""Thinker LM on the GPU: (a) decode ms/step vs the HBM roofline, (b) offline throughput vs
transformers, in one run. Random bf16 weights of the real architecture (same shapes, same cost).

    python benchmarks/bench_gpu_thinker.py --config benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json \
        --json out.json

Writes a JSON with every number and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from graph_timing import graph_replay_ms  # benchmarks/ (the script's folder)

# Device-to-device copy bandwidth measured on the H200 (bytes read + written), ../shared/notes/gpu.md.
HBM_BYTES_PER_S = 4.27e12


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json")
    p.add_argument("--decode-batches", default="1,8,32,128")
    p.add_argument("--decode-context", type=int, default=512, help="prompt length before timing decode")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--throughput", default="32x512x256,256x512x256", help="NxINxOUT cases")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-cases", default="32x512x256,256x512x256")
    p.add_argument("--json", default="bench_gpu_thinker.json")
    return p.parse_args()


def model_dir(config_path: str) -> str:
    d = Path(tempfile.mkdtemp()) / "model"
    d.mkdir()
    (d / "config.json").write_text(Path(config_path).read_text())
    return str(d)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_decode(llm, batches, context, steps, vocab):
    from vllm_omni import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, detokenize=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_per_token = engine.runner.kv_bytes_per_block(engine.model, 1, engine.dtype)
    rows = []
    for b in batches:
        for i, prompt in enumerate(random_prompts(b, context, vocab, seed=b)):
            engine.add_request(f"d{b}-{i}", prompt, params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step()  # prefill everything first
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()  # returns host-side token ids: synchronous
            times.append(time.perf_counter() - start)
        engine.abort_request([f"d{b}-{i}" for i in range(b)])
        ms = statistics.median(times) * 1e3
        replay_ms = graph_replay_ms(engine, b)
        kv_bytes = b * (context + steps // 2) * kv_per_token
        floor_ms = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        rows.append({"batch": b, "ms_per_step": ms, "graph_replay_ms": replay_ms, "roofline_ms": floor_ms,
                     "fraction_of_roofline": floor_ms / ms, "tokens_per_s": b / ms * 1e3})
    return rows


def bench_ours_throughput(llm, n, inp, out, vocab):
    from vllm_omni import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in random_prompts(n, inp, vocab, seed=n)]
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"case": f"{n}x({inp},{out})", "seconds": elapsed, "output_tok_per_s": tokens / elapsed}


def bench_hf_throughput(hf, n, inp, out, vocab):
    ids = torch.tensor(random_prompts(n, inp, vocab, seed=n), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        res = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = res.shape[0] * (res.shape[1] - inp)
    return {"case": f"{n}x({inp},{out})", "seconds": elapsed, "output_tok_per_s": tokens / elapsed}


def main():
    args = parse_args()
    from vllm_omni import LLM

    path = model_dir(args.config)
    cfg = json.loads(Path(args.config).read_text())
    vocab = cfg["vocab_size"]
    result = {"config": args.config, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.85)
    result["ours_startup_s"] = time.perf_counter() - t0
    result["kv_blocks"] = llm.engine.block_manager.num_blocks
    # Warm-up: Triton kernels for prefill/decode shapes compile outside the timings.
    bench_ours_throughput(llm, 4, 64, 8, vocab)
    batches = [int(b) for b in args.decode_batches.split(",")]
    result["decode"] = bench_decode(llm, batches, args.decode_context, args.decode_steps, vocab)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.throughput.split(",")]
    result["ours_throughput"] = [bench_ours_throughput(llm, *c, vocab) for c in cases]
    del llm
    torch.cuda.empty_cache()

    if not args.skip_hf:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.from_pretrained(path)
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
        bench_hf_throughput(hf, 2, 64, 4, vocab)
        hf_cases = [tuple(int(x) for x in c.split("x")) for c in args.hf_cases.split(",")]
        result["hf_throughput"] = [bench_hf_throughput(hf, *c, vocab) for c in hf_cases]

    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"device {result['device']}  torch {result['torch']}  transformers {result['transformers']}")
    print(f"{'batch':>6}{'ms/step':>10}{'graph ms':>10}{'roofline ms':>13}{'% roofline':>12}{'tok/s':>10}")
    for r in result["decode"]:
        replay = r["graph_replay_ms"] or float("nan")
        print(f"{r['batch']:>6}{r['ms_per_step']:>10.2f}{replay:>10.2f}{r['roofline_ms']:>13.2f}"
              f"{100 * r['fraction_of_roofline']:>11.0f}%{r['tokens_per_s']:>10.0f}")
    hf = {r["case"]: r for r in result.get("hf_throughput", [])}
    print(f"{'case':>16}{'ours tok/s':>12}{'hf tok/s':>10}{'speedup':>9}")
    for r in result["ours_throughput"]:
        h = hf.get(r["case"])
        print(f"{r['case']:>16}{r['output_tok_per_s']:>12.0f}"
              + (f"{h['output_tok_per_s']:>10.0f}{r['output_tok_per_s'] / h['output_tok_per_s']:>8.1f}x" if h else ""))


if __name__ == "__main__":
    main()
