"""The Qwen2.5-Omni talker stage on its own: decode ms/step at batch 1, 8, 32 against its roofline.

    python benchmarks/bench_talker_step.py --dummy-config benchmarks/configs/qwen2_5_omni_7b.json \
        --batches 1,8,32 --json talker_step.json      # GPU: random weights of the real architecture
    python benchmarks/bench_talker_step.py             # CPU smoke run on the tiny model

Each request is a finished thinker reply (P prompt rows + R reply rows, random values) with the
bundled deploy config's sampling (temperature 0.9, top-k 40, top-p 0.8, repetition penalty 1.05).
After every request is past its prefill, `--steps` decode steps are timed one by one (each step
returns host-side codes, so it is synchronous). Also reported: the decode CUDA graph replayed
alone (device time, no host work) and the floor (weights + KV read once per step at the HBM
bandwidth). ms/step minus graph replay is what the host adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import TalkerInputs
from vllm_omni.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.27e12  # device-to-device copy bandwidth measured on the H200 (notes/gpu.md)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dummy-config", help="real config.json: random weights of that architecture")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-rows", type=int, default=120, help="thinker prompt tokens P")
    p.add_argument("--reply-rows", type=int, default=128, help="thinker reply tokens R")
    p.add_argument("--context", type=int, default=300, help="codes generated before timing starts")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile", help="write a torch profiler table of the timed steps at each batch here")
    p.add_argument("--json", default="talker_step.json")
    return p.parse_args()


def model_dir(args: argparse.Namespace) -> str:
    out = Path(tempfile.mkdtemp())
    if args.dummy_config:
        from vllm_omni.testing.dummy_checkpoints import make_dummy_omni_checkpoint

        return str(make_dummy_omni_checkpoint(args.dummy_config, out / "dummy"))
    import vllm_omni.testing.tiny_omni  # noqa: F401  (registers "qwen2_5_omni")
    from vllm_omni.testing.tiny_models import make_tiny_model

    return str(make_tiny_model("qwen2_5_omni", out / "tiny"))


def talker_request(engine: LLMEngine, seed: int, prompt_rows: int, reply_rows: int) -> tuple[list[int], dict]:
    g = torch.Generator().manual_seed(seed)
    width = engine.model.config.embedding_size
    inputs = TalkerInputs(thinker_prompt_token_ids=torch.randint(1, 50, (prompt_rows,), generator=g).tolist(),
                          thinker_embeds=torch.randn(prompt_rows + reply_rows, width, generator=g) * 0.02,
                          thinker_hidden=torch.randn(prompt_rows + reply_rows, width, generator=g))
    return [0] * (prompt_rows + 2), inputs.to_info()


def decode_until(engine: LLMEngine, tokens: int) -> None:
    while min(r.num_output_tokens for r in engine.scheduler.running + list(engine.scheduler.waiting)) < tokens:
        engine.step()


def graph_replay_ms(engine: LLMEngine, batch: int, iters: int = 50) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    graph = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        profile_path.write_text(f"{steps} steps\n{table}\n")
    return times


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gpu = torch.cuda.is_available()
    engine = LLMEngine(EngineConfig(
        model=model_dir(args), model_stage="talker", device="cuda" if gpu else "cpu",
        dtype="bfloat16" if gpu else "float32", load_format="dummy" if args.dummy_config else "auto",
        max_num_seqs=max(batches), enable_prefix_caching=False))  # max_model_len: the model's, as deployed
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, ignore_eos=True,
                            max_tokens=args.context + args.steps + 8, detokenize=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_per_token = engine.runner.kv_bytes_per_block(engine.model, 1, engine.dtype)
    rows = []
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            prompt, info = talker_request(engine, i, args.prompt_rows, args.reply_rows)
            engine.add_request(rid, prompt, params, model_inputs=info)
        decode_until(engine, args.context)
        profile_path = Path(args.profile) / f"talker_b{b}.txt" if args.profile else None
        if profile_path is not None:
            profile_path.parent.mkdir(parents=True, exist_ok=True)
        times = timed_steps(engine, args.steps, profile_path)
        engine.abort_request(ids)
        ms = statistics.median(times) * 1e3
        context = args.prompt_rows + 2 + args.context + args.steps // 2
        floor_ms = (weight_bytes + b * context * kv_per_token) / HBM_BYTES_PER_S * 1e3
        row = {"batch": b, "ms_per_step": ms, "graph_replay_ms": graph_replay_ms(engine, b) if gpu else None,
               "roofline_ms": floor_ms, "codes_per_s": b / ms * 1e3}
        rows.append(row)
        print(f"batch {b}: {ms:.3f} ms/step, graph alone {row['graph_replay_ms'] or float('nan'):.3f} ms, "
              f"floor {floor_ms:.3f} ms, {row['codes_per_s']:.0f} codes/s", flush=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name() if gpu
                                           else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
