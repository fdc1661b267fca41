"""CLI: python -m vllm_omni.testing ARCH OUT_DIR [--seed N] [--set key=value ...]

Builds a tiny random-weight checkpoint (see tiny_models.py) and prints its path.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def _parse_value(text: str) -> Any:
    # JSON covers numbers, booleans, null, lists and dicts; anything else is a plain string
    # (so `--set dtype=bfloat16` needs no quotes).
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> None:
    # Nothing may be downloaded; set before transformers is imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_omni.testing.tiny_models import make_tiny_model, tiny_checkpoint_builders

    parser = argparse.ArgumentParser(prog="python -m vllm_omni.testing", description=__doc__)
    parser.add_argument("arch", choices=sorted(tiny_checkpoint_builders()))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="HF config override, VALUE parsed as JSON if possible (repeatable)",
    )
    parser.add_argument("--task-type", choices=["CustomVoice", "VoiceDesign", "Base"],
                        help="qwen3_tts only: which released checkpoint type to build")
    parser.add_argument("--layout", choices=["a14b", "i2v", "ti2v"],
                        help="wan2_2 only: which released model's layout to build (default a14b)")
    args = parser.parse_args(argv)

    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _parse_value(value)
    if args.task_type is not None:
        overrides["task_type"] = args.task_type
    if args.layout is not None:
        overrides["layout"] = args.layout
    print(make_tiny_model(args.arch, args.out_dir, seed=args.seed, **overrides))


if __name__ == "__main__":
    main()
