"""Qwen3-TTS voice cloning: what encoding a new reference costs, encoder by encoder.

A cloning request whose reference the talker has not seen runs two encoders before its first
frame (reference_cache.py): the speaker encoder (log mel on the host, then ECAPA-TDNN) and, for
in-context cloning, Mimi's encoder (the reference's codes). This times each on its own, for
references of several lengths: eagerly (as the talker runs a reference longer than its graphs),
replayed from a graph captured at that exact length (the floor), and as the talker runs them:
its graphs per reference-length bucket (reference_graphs.py); with the kernels each launches.

    python benchmarks/bench_tts_reference.py --real-arch [--seconds 2,5,10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_tts import SAMPLE_RATE, real_arch_checkpoint, tiny_checkpoint  # benchmarks/ (the script's folder)
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import mel_spectrogram


def timed(fn, reps: int) -> float:
    """Median ms of fn() (synchronised), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def graphed(fn):
    """fn captured once (its inputs fixed) -> a replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-arch", action="store_true")
    p.add_argument("--seconds", default="2,5,10")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = real_arch_checkpoint(Path(tmp) / "real", "Base") if args.real_arch else tiny_checkpoint(
            "Base", Path(tmp) / "tiny")
        engine = LLMEngine(EngineConfig(
            model=str(model), model_stage="talker", architecture="Qwen3TTSForConditionalGeneration",
            device="cuda", dtype="bfloat16", load_format="dummy" if args.real_arch else "auto", max_num_seqs=8,
            enable_prefix_caching=False, gpu_memory_utilization=0.3))
        talker = engine.runner.model
        speaker, speech = talker.speaker_encoder, talker.speech_encoder
        rows = []
        for seconds in (float(s) for s in args.seconds.split(",")):
            t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
            audio = torch.from_numpy((0.3 * np.sin(2 * np.pi * 150 * t)).astype("float32"))
            weight = speaker.fc.weight
            mel = mel_spectrogram(audio).to(weight.device, weight.dtype)[None]
            with torch.inference_mode():
                row = {"seconds": seconds,
                       "mel_host_ms": timed(lambda: mel_spectrogram(audio), args.reps),
                       "speaker_embed_ms": timed(lambda: speaker.embed(audio), args.reps),
                       "speaker_forward_ms": timed(lambda: speaker(mel), args.reps),
                       "speaker_kernels": kernels(lambda: speaker(mel)),
                       "mimi_encode_ms": timed(lambda: speech.encode(audio), args.reps),
                       "mimi_kernels": kernels(lambda: speech.encode(audio))}
                graphs = talker.reference_graphs  # what the talker runs: host mel + replay, per bucket
                if graphs is not None:
                    row["talker_graphs_speaker_ms"] = timed(lambda: graphs.embed_speaker(audio), args.reps)
                    row["talker_graphs_codes_ms"] = timed(lambda: graphs.encode_codes(audio), args.reps)
                for name, fn in (("speaker_forward", lambda: speaker(mel)),
                                 ("mimi_encode", lambda: speech.encode(audio))):
                    try:
                        row[f"{name}_graph_ms"] = timed(graphed(fn), args.reps)
                    except Exception as exc:  # what stops a capture is the finding
                        row[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
