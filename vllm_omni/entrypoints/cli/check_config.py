"""`vllm-omni check-config [PATH] [--model M] [--stage-overrides JSON]`.

Validates a stage config the way `serve` would (same loader, same precedence)
and prints the resolved stage graph, without starting any process or loading
weights. Dotted names (workers, schedulers, stage input processors, plugins)
are imported to prove they resolve, unless --no-import is given.
Exit status: 0 valid, 1 invalid (the error goes to stderr).
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check-config",
        help="validate a stage config (legacy stage_args or deploy YAML) and print the resolved stage graph",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", nargs="?", default=None,
                   help="stage config YAML; omitted: the bundled config of --model")
    p.add_argument("--model", default=None,
                   help="model directory or cached hub id: finds the bundled pipeline a deploy config overlays")
    p.add_argument("--stage-overrides", default=None,
                   help='per-stage JSON overrides, e.g. \'{"0": {"gpu_memory_utilization": 0.8}}\'')
    p.add_argument("--strategy-config", default=None,
                   help="upstream's parallel strategy YAML (tp / stage_replica per model_stage) over the config")
    p.add_argument("--async-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="override the deploy YAML's async_chunk")
    p.add_argument("--platform", default=None, choices=("cuda", "rocm", "npu", "xpu", "cpu"),
                   help="whose `platforms:` delta to apply; default: this machine's, and then every "
                        "runtime.devices index must exist here too")
    p.add_argument("--no-import", action="store_true",
                   help="check dotted names' syntax only; do not import them")
    p.add_argument("--json", action="store_true", help="print the resolved config as JSON")


def run(args: argparse.Namespace) -> int:
    from vllm_omni.config import (ConfigError, describe_pipeline, detect_platform, load_pipeline_config,
                                  validate_dotted_names)

    here = args.platform is None
    try:
        pipeline = load_pipeline_config(args.path, model=args.model, stage_overrides=args.stage_overrides,
                                        async_chunk=args.async_chunk, platform=args.platform or detect_platform(),
                                        check_devices=here, strategy_config=args.strategy_config)
        if not args.no_import:
            validate_dotted_names(pipeline)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(pipeline.to_dict(), indent=2))
    else:
        print(describe_pipeline(pipeline))
        if pipeline.ignored:
            print("\nIgnored (no effect on this engine):\n  " + "\n  ".join(i.describe() for i in pipeline.ignored))
        print("\nDotted names: " + ("syntax checked only (--no-import)" if args.no_import else "all resolve"))
        print("OK")
    return 0
