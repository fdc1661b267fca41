"""`vllm-omni generate`: offline generation, on the embedded tiny demo model by default."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text offline (no MODEL: the embedded tiny demo model, random weights)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); chat-formatted when --chat")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")


def run(args: argparse.Namespace) -> int:
    from vllm_omni import LLM, SamplingParams
    from vllm_omni.testing import demo_model_path

    model = args.model or str(demo_model_path())
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    llm = LLM(model, dtype=args.dtype, device=args.device)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    if args.model is None:
        print(f"(embedded demo model at {model}: random weights, so the text is gibberish)")
    for prompt, output in zip(prompts, outputs):
        print(f"prompt: {prompt!r}\noutput: {output.outputs[0].text!r}  [{output.outputs[0].finish_reason}]")
    return 0
