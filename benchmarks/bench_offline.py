"""Offline throughput: our `LLM.generate` vs transformers `generate` on one checkpoint.

Same prompts (random token ids), same output lengths (EOS ignored), greedy, in one
process, one after the other. Prints a table and writes JSON.

    python benchmarks/bench_offline.py --model DIR --num-prompts 64 --input-len 128 --output-len 64
    python benchmarks/bench_offline.py --tiny qwen3          # builds a tiny random checkpoint first
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--tiny", default="qwen3", help="build a tiny random checkpoint of this arch")
    p.add_argument("--tiny-config", default="{}", help='JSON config overrides for --tiny, e.g. \'{"hidden_size": 512}\'')
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch size (default: all prompts)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", default="bench_offline.json", help="where to write the results")
    return p.parse_args()


def make_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, max(11, vocab - 10), (n, length), generator=g).tolist()


def bench_ours(model: str, prompts, output_len: int, dtype: str, device: str) -> dict:
    from vllm_omni import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    sync(llm.engine.device)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(llm.engine.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "device": str(llm.engine.device), "dtype": str(llm.engine.dtype)}


def bench_hf(model: str, prompts, output_len: int, batch_size: int, dtype: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch_device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                ("cpu" if device == "auto" else device))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(torch_device).eval()

    def run(batch):
        ids = torch.tensor(batch, device=torch_device)  # equal lengths: no padding needed
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out.shape[0] * (out.shape[1] - ids.shape[1])

    run(prompts[:2])  # warm-up
    sync(torch_device)
    start = time.perf_counter()
    generated = sum(run(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
    sync(torch_device)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "batch_size": batch_size}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    model = args.model
    if model is None:
        from vllm_omni.testing import make_tiny_model

        overrides = json.loads(args.tiny_config)
        model = str(make_tiny_model(args.tiny, Path(tempfile.mkdtemp()) / args.tiny, seed=0, **overrides))
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(vocab, args.num_prompts, args.input_len)
    result = {
        "model": args.model or f"tiny {args.tiny} {args.tiny_config}",
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "torch": torch.__version__, "transformers": transformers.__version__, "host": platform.node(),
        "threads": torch.get_num_threads(),
        "ours": bench_ours(model, prompts, args.output_len, args.dtype, args.device),
    }
    if not args.skip_hf:
        result["transformers"] = bench_hf(model, prompts, args.output_len, args.hf_batch_size or args.num_prompts,
                                          args.dtype, args.device)
        result["speedup"] = result["ours"]["output_tok_per_s"] / result["transformers"]["output_tok_per_s"]
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{'engine':<14}{'seconds':>10}{'out tokens':>12}{'tok/s':>12}")
    for name in ("ours", "transformers"):
        if name in result:
            r = result[name]
            print(f"{name:<14}{r['seconds']:>10.3f}{r['output_tokens']:>12}{r['output_tok_per_s']:>12.1f}")
    if "speedup" in result:
        print(f"speedup (ours / transformers): {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
