"""The stage-based CLI of `serve` (spec 001): which flag combinations make sense, and the
headless command. The head is the ordinary server with three more AsyncOmni arguments.

    vllm-omni serve MODEL --stage-id 0 --omni-master-address A --omni-master-port P     # head + API
    vllm-omni serve MODEL --headless --stage-id 1 --omni-master-address A --omni-master-port P
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger("vllm_omni.serve")


def problems(args: argparse.Namespace) -> list[str]:
    """Combinations refused before anything starts."""
    found = []
    if args.stage_id is not None and args.stage_id < 0:
        found.append("--stage-id must be >= 0")
    master = (args.omni_master_address, args.omni_master_port)
    if (master[0] is None) != (master[1] is None):
        found.append("--omni-master-address and --omni-master-port go together: the address and port where the "
                     "head listens for headless stages")
    if args.omni_master_port is not None and not 0 < args.omni_master_port < 65536:
        found.append("--omni-master-port must be a TCP port (1-65535)")
    if args.headless:
        if args.stage_id is None:
            found.append("--headless needs --stage-id: the stage this process runs")
        if args.omni_master_address is None:
            found.append("--headless needs --omni-master-address and --omni-master-port: the head it serves")
    elif args.omni_replica_address is not None:
        found.append("--omni-replica-address is the address a --headless stage advertises; the head listens on "
                     "--omni-master-address")
    if args.worker_backend != "multi_process" and (args.headless or args.omni_master_address is not None):
        found.append("the stage-based CLI (--headless, --omni-master-address) runs stages as processes; it does not "
                     "combine with --worker-backend ray (Ray places stages on its cluster itself)")
    return found


def head_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """AsyncOmni's arguments for the head (none of them when the stage-based CLI is not used)."""
    return {"stage_id": args.stage_id, "master_address": args.omni_master_address,
            "master_port": args.omni_master_port}


def run_headless(args: argparse.Namespace, model: str, stage_overrides: Any, engine_args: dict[str, Any]) -> int:
    from vllm_omni.engine.headless import HeadlessOptions, run_headless as serve_stage
    from vllm_omni.entrypoints.omni_base import load_pipeline

    try:
        pipeline = load_pipeline(model, args.stage_configs_path, args.deploy_config, stage_overrides, engine_args,
                                 async_chunk=args.async_chunk, stage_id=args.stage_id,
                                 strategy_config=args.strategy_config)
        pipeline.stage(args.stage_id)
    except (KeyError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("stage %d cannot start: %s", args.stage_id, e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before any replica started: nothing to stop
        logger.info("stage %d: interrupted while loading its config", args.stage_id)
        return 130
    options = HeadlessOptions(args.stage_id, args.omni_master_address, args.omni_master_port,
                              args.omni_replica_address, float(args.stage_init_timeout), float(args.shutdown_timeout))
    try:
        return serve_stage(pipeline, model, options)
    except OSError as e:  # e.g. a master address that does not resolve, or a replica address not of this host
        logger.error("stage %d cannot start: %s", args.stage_id, e)
        return 1
