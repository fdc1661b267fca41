"""A talker stage on its own: decode ms/step (= ms per codec frame) at batch 1, 8, 32 against
its roofline, for Qwen2.5-Omni and Qwen3-Omni (whose step includes the code predictor's frame).

    python benchmarks/bench_talker_step.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
        --batches 1,8,32 --json talker_step.json      # GPU: random weights of the real architecture
    python benchmarks/bench_talker_step.py --dummy-config benchmarks/configs/qwen3_omni_30b_a3b.json
    python benchmarks/bench_talker_step.py [--family qwen3_omni]   # CPU smoke run on a tiny model

Each request is a finished thinker reply (a ChatML prompt of P tokens, R reply rows of random
hidden states) handed over by the family's own thinker2talker bridge, with the bundled deploy
config's talker sampling.
After every request is past its prefill, `--steps` decode steps are timed one by one (each step
returns host-side codes, so it is synchronous). Also reported: the decode CUDA graph replayed
alone (device time, no host work), for Qwen3-Omni its code predictor's frame graph alone, and
the floor (weights + KV read once per step at the HBM bandwidth). ms/step minus graph replay is
what the host adds. `admit ms` is the host time of one `add_request` (the talker prompt laid
out, its rows projected: what a burst of arrivals pays per request before the talker's next
step), the mean over the batch's requests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from graph_timing import graph_replay_ms, predictor_replay_ms  # benchmarks/ (the script's folder)
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.testing.talker_inputs import chat_prompt_ids, talker_prompt

HBM_BYTES_PER_S = 4.27e12  # device-to-device copy bandwidth measured on the H200 (notes/gpu.md)
# The bundled deploy configs' talker sampling (vllm_omni/deploy/*.yaml, stage 1).
SAMPLING = {"qwen2_5_omni": dict(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05),
            "qwen3_omni": dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dummy-config", help="real config.json: random weights of that architecture")
    p.add_argument("--family", choices=sorted(SAMPLING), help="default: from --dummy-config, else qwen2_5_omni")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-words", type=int, default=100, help="user words of the thinker's ChatML prompt")
    p.add_argument("--reply-rows", type=int, default=128, help="thinker reply tokens R")
    p.add_argument("--context", type=int, default=300, help="codes generated before timing starts")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, help="every request seeded (the bundled configs set 42): each row draws "
                                            "its noise from its own generator")
    p.add_argument("--profile", help="write torch profiler tables (host, then device time) of the timed steps at "
                                     "each batch here")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager): the profile then times "
                                                        "each kernel of the step")
    p.add_argument("--json", default="talker_step.json")
    args = p.parse_args()
    if args.family is None:
        args.family = "qwen3_omni" if args.dummy_config and "qwen3" in Path(args.dummy_config).name else "qwen2_5_omni"
    return args


def model_dir(args: argparse.Namespace) -> str:
    out = Path(tempfile.mkdtemp())
    if args.dummy_config:
        from vllm_omni.testing.dummy_checkpoints import make_dummy_omni_checkpoint

        return str(make_dummy_omni_checkpoint(args.dummy_config, out / "dummy"))
    from vllm_omni.testing.tiny_models import make_tiny_model

    return str(make_tiny_model({"qwen3_omni": "qwen3_omni_moe"}.get(args.family, args.family), out / "tiny"))


def chat_prompt(args: argparse.Namespace, model: str) -> list[int]:
    if args.dummy_config:  # the real vocabulary's special ids (the dummy checkpoint's tokenizer is tiny)
        from vllm_omni.testing.dummy_checkpoints import chat_prompt_ids as real_vocab_prompt

        return real_vocab_prompt(args.prompt_words)
    return chat_prompt_ids(model, args.prompt_words)


def decode_until(engine: LLMEngine, tokens: int) -> None:
    while min(r.num_output_tokens for r in engine.scheduler.running + list(engine.scheduler.waiting)) < tokens:
        engine.step()


def timed_steps(engine: LLMEngine, steps: int, profile_path: Path | None) -> list[float]:
    prof = None
    if profile_path is not None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts)
        prof.__enter__()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if prof is not None:
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        host = averages.table(sort_by="self_cpu_time_total", row_limit=40)
        device = averages.table(sort_by="self_device_time_total", row_limit=40) if torch.cuda.is_available() else ""
        profile_path.write_text(f"{steps} steps\n{host}\n{device}\n")
    return times


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gpu = torch.cuda.is_available()
    engine = LLMEngine(EngineConfig(
        model=model_dir(args), model_stage="talker", device="cuda" if gpu else "cpu",
        dtype="bfloat16" if gpu else "float32", load_format="dummy" if args.dummy_config else "auto",
        max_num_seqs=max(batches), enable_prefix_caching=False,  # max_model_len: the model's, as deployed
        enforce_eager=args.eager))
    params = SamplingParams(**SAMPLING[args.family], ignore_eos=True, max_tokens=args.context + args.steps + 8,
                            detokenize=False, seed=args.seed)
    prompt_ids = chat_prompt(args, engine.config.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_per_token = engine.runner.kv_bytes_per_block(engine.model, 1, engine.dtype)
    rows = []
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        prompts = [talker_prompt(engine.model, args.family, prompt_ids, args.reply_rows, i) for i in range(b)]
        admit = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt["prompt_token_ids"], params, model_inputs=prompt["additional_information"])
        admit_ms = (time.perf_counter() - admit) * 1e3 / b
        decode_until(engine, args.context)
        profile_path = Path(args.profile) / f"talker_b{b}.txt" if args.profile else None
        if profile_path is not None:
            profile_path.parent.mkdir(parents=True, exist_ok=True)
        times = timed_steps(engine, args.steps, profile_path)
        engine.abort_request(ids)
        ms = statistics.median(times) * 1e3
        context = len(prompt_ids) + 2 + args.context + args.steps // 2
        floor_ms = (weight_bytes + b * context * kv_per_token) / HBM_BYTES_PER_S * 1e3
        row = {"batch": b, "ms_per_step": ms, "graph_replay_ms": graph_replay_ms(engine, b) if gpu else None,
               "predictor_replay_ms": predictor_replay_ms(engine, b) if gpu else None,
               "roofline_ms": floor_ms, "codes_per_s": b / ms * 1e3, "admit_ms": admit_ms}
        rows.append(row)
        predictor = f", predictor graph {row['predictor_replay_ms']:.3f} ms" if row["predictor_replay_ms"] else ""
        graph = row["graph_replay_ms"] or float("nan")
        print(f"batch {b}: {ms:.3f} ms/step, graph alone {graph:.3f} ms{predictor}, "
              f"floor {floor_ms:.3f} ms, {row['codes_per_s']:.0f} codes/s, admit {admit_ms:.2f} ms a request", flush=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name() if gpu
                                           else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
