"""Load time of an AR stage's checkpoint with 1 and N reader threads (--num-weight-load-threads).

Writes a random checkpoint with the real layout of a stage (Qwen2.5-Omni-7B's thinker by default:
its tensor names and shapes, bf16, in shards of about --shard-gb like the published checkpoint)
into a temporary folder, then times `load_model` (the stage engine's loader: construction on
the device, then the checkpoint copied in) for each thread count. "cold" runs read from the disk
(the files are dropped from the page cache first, with fsync + posix_fadvise DONTNEED); "warm"
runs read from the page cache.

    # the H200 (the 7B thinker, ~18 GB; the folder needs that much disk):
    python benchmarks/bench_weight_load.py --device cuda --threads 1 8 --json weight_load.json
    # a small run on a CPU (2 thinker layers, a small vocabulary):
    python benchmarks/bench_weight_load.py --device cpu --text-layers 2 --encoder-layers 1 \
        --vocab-size 8192 --shard-gb 0.25 --threads 1 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_omni.model_executor.model_loader import load_hf_config, load_model, safetensors_files  # noqa: E402

DEFAULT_CONFIG = Path(__file__).with_name("configs") / "qwen2_5_omni_7b.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Qwen2.5-Omni config.json")
    p.add_argument("--model-stage", default="thinker")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=2, help="timed loads per thread count and cache state")
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size (the published 7B has ~4 GB shards)")
    p.add_argument("--text-layers", type=int, default=None, help="shrink: thinker LM layers")
    p.add_argument("--encoder-layers", type=int, default=None, help="shrink: audio and vision encoder layers")
    p.add_argument("--vocab-size", type=int, default=None, help="shrink: the thinker's vocabulary")
    p.add_argument("--tmpdir", default=None, help="where the checkpoint is written (default: the system's)")
    p.add_argument("--warm-only", action="store_true", help="skip the cold (from disk) runs")
    p.add_argument("--json", default=None)
    return p.parse_args()


def shrunk_config(args: argparse.Namespace) -> dict:
    config = json.loads(Path(args.config).read_text())
    thinker = config["thinker_config"]
    if args.text_layers is not None:
        thinker["text_config"]["num_hidden_layers"] = args.text_layers
    if args.encoder_layers is not None:
        thinker["audio_config"]["encoder_layers"] = args.encoder_layers
        thinker["vision_config"]["depth"] = args.encoder_layers
    if args.vocab_size is not None:
        thinker["text_config"]["vocab_size"] = args.vocab_size
    return config


def checkpoint_shapes(folder: Path, stage: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The stage's tensors as the published checkpoint names them (transformers' module on meta)."""
    import transformers

    config = load_hf_config(folder)
    cls = getattr(transformers, f"Qwen2_5Omni{stage.capitalize()}ForConditionalGeneration")
    with torch.device("meta"):
        module = cls._from_config(getattr(config, f"{stage}_config"))
    return {f"{stage}.{name}": (t.shape, t.dtype) for name, t in module.state_dict().items()}


def write_checkpoint(folder: Path, shapes: dict, dtype: torch.dtype, shard_bytes: int) -> int:
    """Random tensors in shards of about shard_bytes, with the index file; returns the total bytes."""
    weight_map: dict[str, str] = {}
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in shapes.items():
        nbytes = shape.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    total = 0
    gen = torch.Generator().manual_seed(0)
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n][0], generator=gen) * 0.02).to(dtype) for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        print(f"  wrote {file}: {len(names)} tensors", flush=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


def drop_page_cache(folder: Path) -> None:
    for path in safetensors_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_load(folder: Path, config, args: argparse.Namespace, threads: int) -> float:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    model = load_model(folder, config, args.dtype, args.device, model_stage=args.model_stage, load_threads=threads)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(shrunk_config(args)))
        shapes = checkpoint_shapes(folder, args.model_stage)
        print(f"writing {len(shapes)} tensors of the {args.model_stage} to {folder}", flush=True)
        total = write_checkpoint(folder, shapes, dtype, int(args.shard_gb * 2**30))
        config = load_hf_config(folder)
        timed_load(folder, config, args, args.threads[0])  # imports, CUDA context, allocator warm-up
        rows = []
        for cache in (("warm",) if args.warm_only else ("cold", "warm")):
            for threads in args.threads:
                times = []
                for _ in range(args.repeats):
                    if cache == "cold":
                        drop_page_cache(folder)
                    else:
                        timed_load(folder, config, args, threads)  # the files are in the page cache now
                    times.append(timed_load(folder, config, args, threads))
                best = min(times)
                rows.append({"cache": cache, "threads": threads, "seconds": best, "all_seconds": times,
                             "gb_per_s": total / best / 1e9})
                print(f"{cache:5s} {threads:3d} threads: {best:7.2f} s  {total / best / 1e9:6.2f} GB/s  {times}",
                      flush=True)
    result = {"config": args.config, "model_stage": args.model_stage, "device": args.device, "dtype": args.dtype,
              "bytes": total, "num_tensors": len(shapes), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
