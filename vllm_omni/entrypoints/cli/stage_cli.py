"""The stage-based CLI of `serve` (spec 001): which flag combinations make sense, the stage
transport's flags (the cluster secret and the caps), and the headless command. The head is the
ordinary server with a few more AsyncOmni arguments.

    vllm-omni serve MODEL --stage-id 0 --omni-master-address A --omni-master-port P     # head + API
    vllm-omni serve MODEL --headless --stage-id 1 --omni-master-address A --omni-master-port P

Across hosts every command needs the same cluster secret ($VLLM_OMNI_SECRET or --omni-secret-file).
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from vllm_omni.engine.cluster_secret import CurveKeys, listen_problem, load_cluster_keys
from vllm_omni.engine.transport_guard import (
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REPLICAS_PER_STAGE, DEFAULT_REGISTRATION_RATE,
)

logger = logging.getLogger("vllm_omni.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The stage transport's flags (docs/operations.md, "Security: the stage transport")."""
    group = parser.add_argument_group("stage transport (the stage-based CLI's TCP links)")
    group.add_argument("--omni-secret-file", default=None, metavar="PATH",
                       help="File (mode 0600) holding the cluster secret that the head and every headless stage "
                            "share: each TCP link between them is authenticated and encrypted with keys derived "
                            "from it (CurveZMQ). Default: the environment variable VLLM_OMNI_SECRET. Without "
                            "either, the stage transport listens on loopback addresses only.")
    group.add_argument("--omni-max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                       help="Largest message between the orchestrator and a stage (its tensors included); a larger "
                            "one is refused by its sender and dropped (and counted) by its receiver.")
    group.add_argument("--omni-max-replicas-per-stage", type=int, default=DEFAULT_MAX_REPLICAS_PER_STAGE,
                       help="Head: the most replicas a stage may have; a headless stage registering beyond it is "
                            "told to try again later.")
    group.add_argument("--omni-registration-rate", type=float, default=DEFAULT_REGISTRATION_RATE,
                       help="Head: registrations of headless stages accepted per second (and at once); more are "
                            "told to try again a moment later.")


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
    return found + _transport_problems(args)


def _transport_problems(args: argparse.Namespace) -> list[str]:
    found = [f"--{name.replace('_', '-')} must be >= 1" for name in ("omni_max_message_bytes",
                                                                     "omni_max_replicas_per_stage")
             if getattr(args, name) < 1]
    if args.omni_registration_rate <= 0:
        found.append("--omni-registration-rate must be > 0")
    if args.omni_master_address is None:
        return found
    try:
        keys = load_cluster_keys(args.omni_secret_file)
    except ValueError as e:
        return [*found, str(e)]
    # Where this process would listen for stage traffic: the head on the master address; a headless
    # stage on its replica address (unset: its route to the master, a loopback one for a loopback master).
    if args.headless:
        host, flag = args.omni_replica_address or args.omni_master_address, "--omni-replica-address"
    else:
        host, flag = args.omni_master_address, "--omni-master-address"
    problem = listen_problem(host, keys, flag)
    return found + ([problem] if problem else [])


def cluster_keys(args: argparse.Namespace) -> CurveKeys | None:
    """The cluster secret's keys (checked by `problems` already)."""
    return load_cluster_keys(args.omni_secret_file)


def head_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """AsyncOmni's arguments for the head (the stage-based CLI's, and the stage transport's caps)."""
    return {"stage_id": args.stage_id, "master_address": args.omni_master_address,
            "master_port": args.omni_master_port, "omni_secret_file": args.omni_secret_file,
            "max_message_bytes": args.omni_max_message_bytes,
            "max_replicas_per_stage": args.omni_max_replicas_per_stage,
            "registration_rate": args.omni_registration_rate}


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
                              args.omni_replica_address, float(args.stage_init_timeout), float(args.shutdown_timeout),
                              keys=cluster_keys(args), max_message_bytes=args.omni_max_message_bytes)
    try:
        return serve_stage(pipeline, model, options)
    except (OSError, ValueError) as e:  # e.g. an address that does not resolve, or not loopback without a secret
        logger.error("stage %d cannot start: %s", args.stage_id, e)
        return 1
