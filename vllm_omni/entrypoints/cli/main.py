"""`vllm-omni` command line: one subcommand per module, each with add_parser/run."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing `add_parser(subparsers)` and `run(args) -> int`
SUBCOMMANDS = {
    "generate": "vllm_omni.entrypoints.cli.generate",
    "check-config": "vllm_omni.entrypoints.cli.check_config",
    "serve": "vllm_omni.entrypoints.cli.serve",
    "bench": "vllm_omni.entrypoints.cli.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-omni", description="Serving for multi-stage any-to-any models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vllm_omni.entrypoints.cli.serve_args import fold_dotted_flags

    args = build_parser().parse_args(fold_dotted_flags(sys.argv[1:] if argv is None else argv))
    return int(importlib.import_module(SUBCOMMANDS[args.command]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
