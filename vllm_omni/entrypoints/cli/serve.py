"""`vllm-omni serve [MODEL] [flags]`, also installed as `vllm serve MODEL --omni` (spec 001).

With no MODEL the server runs the embedded tiny demo model (random weights, built locally on
first use), so text and speech come out on any laptop with no GPU and no download.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.cli import serve_args, stage_cli

logger = logging.getLogger("vllm_omni.serve")

DEMO_SERVED_NAME = "vllm-omni-demo"
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "org/name" (or a legacy "name"), as on the Hugging Face hub
_VLLM_USAGE = ("this `vllm` command is vLLM-Omni's and only runs `vllm serve [MODEL] --omni [flags]` and "
               "`vllm bench serve [flags]`; everything else is `vllm-omni --help`")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible API server (no MODEL: the embedded tiny demo model)",
        description="Start the OpenAI-compatible API server. Without MODEL it serves the embedded tiny demo "
                    "omni model (random weights), so text and speech work with no GPU and no download.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve_args.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return serve(args)


def vllm_main(argv: list[str] | None = None) -> int:
    """The `vllm` console script: only `vllm serve ... --omni` and `vllm bench serve ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # upstream's benchmark client: `vllm bench serve --omni ...`
        from vllm_omni.entrypoints.cli.main import main

        return main(argv)
    if not argv or argv[0] != "serve":
        print(f"error: {_VLLM_USAGE}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="vllm serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="vLLM-Omni's OpenAI-compatible API server (needs --omni).")
    serve_args.add_arguments(parser)
    args = parser.parse_args(serve_args.fold_dotted_flags(argv[1:]))
    if not args.omni:
        print(f"error: add --omni: {_VLLM_USAGE}", file=sys.stderr)
        return 2
    return serve(args)


def _configure_logging(log_file: str | None) -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    if log_file:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(fmt))
        logging.getLogger().addHandler(handler)


def _check(args: argparse.Namespace) -> list[str]:
    problems = serve_args.refused_flags(args) + stage_cli.problems(args)
    if args.stage_configs_path is not None and args.deploy_config is not None:
        problems.append("--stage-configs-path and --deploy-config are mutually exclusive (legacy stage_args YAML "
                        "or a deploy YAML, not both)")
    for name in ("max_concurrent_requests", "max_media_bytes", "max_request_bytes", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_queued_requests", "batch_timeout", "media_fetch_timeout", "shutdown_timeout",
                 "max_stage_restarts"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.tts_max_instructions_length is not None and args.tts_max_instructions_length < 1:
        problems.append("--tts-max-instructions-length must be >= 1")
    if not 0.0 <= args.admission_headroom < 1.0:
        problems.append("--admission-headroom must be in [0, 1)")
    if args.omni_heartbeat_timeout <= 0:
        problems.append("--omni-heartbeat-timeout must be > 0")
    if args.omni_dp_size_local < 1:
        problems.append("--omni-dp-size-local must be >= 1")
    if args.worker_backend != "multi_process" or args.ray_address is not None:
        from vllm_omni.engine.ray_cluster import worker_backend_problem

        backend = worker_backend_problem(args.worker_backend, args.ray_address)
        problems += [backend] if backend is not None else []
    return problems


def serve(args: argparse.Namespace) -> int:
    problems = _check(args)  # before anything heavy: a bad flag costs no model loading
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    missing = _missing_hub_model(args)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    _configure_logging(args.log_file)
    if args.replica_id is not None:
        logger.warning("--replica-id is deprecated and ignored: replica ids are assigned automatically")
    if args.init_sleep_seconds is not None:
        logger.warning("--init-sleep-seconds is deprecated and ignored: stages start together and report when "
                       "they are ready (bounded by --stage-init-timeout / --init-timeout)")
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated: requests are not logged unless --enable-log-requests")
    if args.headless:  # no API server: the stage serves the head at --omni-master-address
        model, _ = _model(args)
        return stage_cli.run_headless(args, model, serve_args.stage_overrides(args), serve_args.engine_args(args))

    from vllm_omni.entrypoints.openai import input_limits
    from vllm_omni.entrypoints.openai.api_server import ServerSettings, bind_socket, local_media_root, run_server
    from vllm_omni.entrypoints.openai.chat_options import ChatOptions, load_chat_template

    try:
        media = input_limits.media_policy(args, local_media_root(args.allowed_local_media_path))
        chat = ChatOptions(chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
                           limit_mm_per_prompt=args.limit_mm_per_prompt or {},
                           audio_stream_shape=args.audio_stream_shape)
        video = serve_args.video_store.from_args(args)
        voices, speech_stream = serve_args.tts_limits.voice_limits(args), serve_args.tts_limits.speech_stream_limits(args)
        speech_batch = serve_args.tts_limits.speech_batch_limits(args)
        sock = bind_socket(args.host, args.port)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    model, names = _model(args)
    task_problem = _check_task_type(args.task_type, model)
    if task_problem:
        print(f"error: {task_problem}", file=sys.stderr)
        sock.close()
        return 2
    settings = ServerSettings(
        model_path=model, served_names=names, host=args.host, port=args.port, api_key=args.api_key, media=media,
        max_concurrent_requests=args.max_concurrent_requests, max_queued_requests=args.max_queued_requests,
        admission_timeout_s=args.batch_timeout, max_request_bytes=args.max_request_bytes,
        uvicorn_log_level=args.uvicorn_log_level, realtime=serve_args.realtime_limits.from_args(args),
        voices=voices, speech_stream=speech_stream, speech_batch=speech_batch,
        chat=chat, log_requests=args.enable_log_requests, max_prompts_per_request=args.max_prompts_per_request,
        shutdown_timeout_s=args.shutdown_timeout, max_diffusion_prompt_chars=args.max_diffusion_prompt_chars,
        video=video,
    )
    try:
        engine = _start_engine(args, model, media)
    except Exception as e:  # noqa: BLE001 - config errors, a stage that failed or timed out: say why, exit 1
        logger.error("the pipeline failed to start: %s", e)
        sock.close()
        return 1
    limit = _tts_instructions_limit(args.tts_max_instructions_length, engine.pipeline)
    run_server(engine, settings if limit is None else replace(settings, tts_max_instructions_length=limit), sock)
    return 0


def _tts_instructions_limit(flag: int | None, pipeline: Any) -> int | None:
    """--tts-max-instructions-length, else a stage config's (upstream's tts_args), as upstream ranks them."""
    if flag is not None:
        return flag
    return next((s.tts_max_instructions_length for s in pipeline.stages if s.tts_max_instructions_length), None)


def _missing_hub_model(args: argparse.Namespace) -> str | None:
    """MODEL as a hub id that is not on this machine: say how to get it (nothing is downloaded)."""
    model = args.model
    if model is None or args.stage_configs_path or args.deploy_config or Path(model).expanduser().exists():
        return None
    if model.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(model):
        return f"MODEL {model!r} is not a folder on this machine"
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return None  # in the Hugging Face cache: served from there
    except HFValidationError:
        return f"MODEL {model!r} is not a folder on this machine, nor a Hugging Face hub id"
    return (f"MODEL {model!r} is neither a local folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
            f"and vllm-omni does not download models. Get it with `hf download {model}` (a gated model needs "
            "`hf auth login` or HF_TOKEN first), then run this command again, or pass the folder it is in.")


def _check_task_type(task_type: str | None, model: str) -> str | None:
    """--task-type must name what the TTS checkpoint is (one checkpoint serves one task type)."""
    if task_type is None:
        return None
    from vllm_omni.model_executor.models.families import speech_model

    info = speech_model(model)
    if info is None:
        return f"--task-type {task_type} is for text-to-speech models; {model} is not one"
    if info.task_type != task_type:
        return f"--task-type {task_type} does not match the checkpoint, a {info.task_type} model"
    return None




def _model(args: argparse.Namespace) -> tuple[str, list[str]]:
    if args.model is not None:
        return args.model, args.served_model_name or [args.model]
    from vllm_omni.testing import demo_model_path

    path = str(demo_model_path())
    logger.info("no MODEL given: serving the embedded tiny demo model (random weights, so its text and speech "
                "are noise) from %s", path)
    return path, args.served_model_name or [DEMO_SERVED_NAME]


def _start_engine(args: argparse.Namespace, model: str, media: Any):
    """`media`: the server's MediaPolicy, which the input processor reads and decodes under too."""
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    return AsyncOmni(
        model=model, stage_configs_path=args.stage_configs_path, deploy_config=args.deploy_config,
        stage_overrides=serve_args.stage_overrides(args), stage_init_timeout=args.stage_init_timeout,
        init_timeout=args.init_timeout, shm_threshold_bytes=args.shm_threshold_bytes, log_stats=args.log_stats,
        async_chunk=args.async_chunk, heartbeat_timeout=args.omni_heartbeat_timeout,
        max_stage_restarts=args.max_stage_restarts, lb_policy=args.omni_lb_policy, worker_backend=args.worker_backend,
        ray_address=args.ray_address, media_policy=media, admission_policy=args.admission_policy,
        admission_headroom=args.admission_headroom, admission_max_wait=args.batch_timeout,
        **stage_cli.head_arguments(args),
        **serve_args.engine_args(args), **({"strategy_config": args.strategy_config} if args.strategy_config else {}),
    )
