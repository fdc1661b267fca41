"""Tensor parallel: decode ms/step at batch 1/8/32, TP=1 against TP=2, with the per-GPU roofline.

Random weights of the real architecture (load_format "dummy": same shapes and cost; the same
model at every TP size), bf16, one engine at a time in this process (rank 0) plus its rank
processes. TP > 1 runs eagerly, so TP=1 is timed both with its CUDA graphs and eagerly.

    python benchmarks/bench_tp.py --config benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json
    python benchmarks/bench_tp.py --config benchmarks/configs/qwen3_omni_30b_a3b.json --model-stage thinker
    python benchmarks/bench_tp.py --cpu-smoke     # tiny model on the CPU (gloo): checks the script runs

Roofline: a decode step reads every weight and the batch's KV cache once; with N ranks each GPU
reads its 1/N of both (KV heads replicated when there are fewer than N), at the H200's
measured copy bandwidth. The all-reduces (2 per layer) are not in it: their count is printed.
The greedy tokens of every TP size are compared with TP=1's on the same prompts.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Device-to-device copy bandwidth measured on the H200 (bytes read + written), shared/notes/gpu.md.
HBM_BYTES_PER_S = 4.27e12


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="benchmarks/configs/qwen2_5_omni_7b_thinker_lm.json",
                   help="a config.json: an LM, or a whole Omni model with --model-stage")
    p.add_argument("--model-stage", default=None, help="e.g. thinker, for a whole Omni config")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=512, help="prompt length before timing decode")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", default="bench_tp.json")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny qwen3 on the CPU, a few steps")
    return p.parse_args()


def model_dir(config_path: str) -> str:
    d = Path(tempfile.mkdtemp()) / "model"
    d.mkdir()
    (d / "config.json").write_text(Path(config_path).read_text())
    return str(d)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def text_config(engine):
    config = engine.hf_config
    config = getattr(config, "thinker_config", config)
    return getattr(config, "text_config", config)


def roofline_ms(engine, batch: int, context: int) -> float:
    """Bytes one GPU reads per decode step / HBM bandwidth (rank 0's shard is every rank's size)."""
    from vllm_omni.core.model_runner import ARModelRunner

    model = engine.model
    # A decode step reads the decoder and the LM head, not the audio/vision towers.
    towers = {n for n, _ in model.named_children() if n in ("audio_tower", "visual")}
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.split(".")[0] not in towers)
    kv_per_token = ARModelRunner.kv_bytes_per_block(model, 1, engine.dtype)  # rank 0's heads
    return (weights + batch * context * kv_per_token) / HBM_BYTES_PER_S * 1e3


def decode_ms(engine, batch: int, context: int, steps: int, vocab: int) -> tuple[float, list[list[int]]]:
    """Median ms of a decode step with `batch` requests `context` tokens deep; their tokens."""
    from vllm_omni import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, detokenize=False)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, context, vocab, seed=batch)):
        engine.add_request(rid, prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything first
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns host-side token ids: synchronous
        times.append(time.perf_counter() - start)
    tokens = [list(engine.scheduler.requests[rid].output_token_ids) for rid in ids]
    engine.abort_request(ids)
    return statistics.median(times) * 1e3, tokens


def run_engine(path: str, args, tp: int, eager: bool, device: str, dtype: str, vocab: int) -> dict:
    from vllm_omni import LLM

    start = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, device=device,
              max_model_len=args.context + args.steps + 64, max_num_seqs=max(args.batches_list),
              model_stage=args.model_stage, tensor_parallel_size=tp, enforce_eager=eager,
              gpu_memory_utilization=0.85)
    engine = llm.engine
    row = {"tp": tp, "eager": eager or tp > 1 or device != "cuda", "startup_s": time.perf_counter() - start,
           "batches": []}
    decode_ms(engine, 2, 16, 4, vocab)  # warm-up: kernels compile outside the timings
    for batch in args.batches_list:
        ms, tokens = decode_ms(engine, batch, args.context, args.steps, vocab)
        row["batches"].append({"batch": batch, "ms_per_step": ms, "tokens": tokens,
                               "roofline_ms": roofline_ms(engine, batch, args.context)})
    row["allreduces_per_step"] = 2 * text_config(engine).num_hidden_layers if tp > 1 else 0
    if tp > 1:
        engine.runner.close()
    del llm, engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    args = parse_args()
    args.batches_list = [int(b) for b in args.batches.split(",")]
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if args.cpu_smoke:
        from vllm_omni.testing.tiny_models import make_tiny_model

        path, device, dtype = str(make_tiny_model("qwen3", Path(tempfile.mkdtemp()) / "qwen3")), "cpu", "float32"
        args.batches_list, args.context, args.steps = [1, 8], 32, 8
        torch.set_num_threads(1)  # the ranks share the cores
    else:
        path, device, dtype = model_dir(args.config), "cuda", "bfloat16"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    vocab = getattr(getattr(config, "thinker_config", config), "text_config", config).vocab_size
    runs = [(1, False)] + [(1, True)] * (device == "cuda") + [(tp, True) for tp in tp_sizes if tp > 1]
    rows = [run_engine(path, args, tp, eager, device, dtype, vocab) for tp, eager in runs]
    reference = [b["tokens"] for b in rows[0]["batches"]]
    for row in rows:
        for got, ref in zip(row["batches"], reference):
            pairs = [(a, b) for x, y in zip(got.pop("tokens"), ref) for a, b in zip(x, y)]
            got["tokens_equal_to_tp1"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
    result = {"config": args.config if not args.cpu_smoke else "tiny qwen3 (cpu smoke)", "device":
              torch.cuda.get_device_name() if device == "cuda" else "cpu", "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "runs": rows}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{result['config']} on {result['device']} (x{result['gpus']})  torch {result['torch']}")
    print(f"{'tp':>3}{'mode':>7}{'batch':>7}{'ms/step':>10}{'roofline':>10}{'% roof':>8}{'speedup':>9}"
          f"{'same tok':>10}{'allreduce':>11}")
    base = {b["batch"]: b["ms_per_step"] for b in rows[0]["batches"]}
    for row in rows:
        for b in row["batches"]:
            print(f"{row['tp']:>3}{'eager' if row['eager'] else 'graphs':>7}{b['batch']:>7}{b['ms_per_step']:>10.2f}"
                  f"{b['roofline_ms']:>10.2f}{100 * b['roofline_ms'] / b['ms_per_step']:>7.0f}%"
                  f"{base[b['batch']] / b['ms_per_step']:>8.2f}x{100 * b['tokens_equal_to_tp1']:>9.0f}%"
                  f"{row['allreduces_per_step']:>11}")


if __name__ == "__main__":
    main()
