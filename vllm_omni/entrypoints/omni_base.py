"""What `Omni` and `AsyncOmni` share: their constructor arguments, the runtime they start, and
the calls that read it (pipeline, tokenizer, health) or close it."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.cluster_secret import load_cluster_keys
from vllm_omni.engine.load_balancer import DEFAULT_LB_POLICY
from vllm_omni.engine.orchestrator import RuntimeOptions
from vllm_omni.engine.playback_admission import AdmissionOptions
from vllm_omni.engine.request_plan import available_modalities
from vllm_omni.engine.runtime import OmniRuntime
from vllm_omni.engine.stage_client import StageHealth
from vllm_omni.engine.transport_guard import (
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REPLICAS_PER_STAGE, DEFAULT_REGISTRATION_RATE, DropKey,
)
from vllm_omni.entrypoints.main_guard import check_main_module_guarded
from vllm_omni.multimodal.media_policy import TRUSTED, MediaPolicy
from vllm_omni.stage_io import StageInfo

_Self = TypeVar("_Self", bound="OmniBase")


def load_pipeline(model: str, stage_configs_path: str | None, deploy_config: str | None,
                  stage_overrides: str | Mapping[Any, Any] | None, engine_args: dict[str, Any],
                  output_modalities: Sequence[str] | None = None, async_chunk: bool | None = None,
                  stage_id: int | None = None, strategy_config: str | None = None) -> PipelineConfig:
    """Parse every config input once (DESIGN 6) and check that its dotted names import.

    `stage_id` (the stage-based CLI's --stage-id): this process runs that stage alone, so the
    engine flags apply to it alone and only its devices must exist here."""
    from vllm_omni.config import detect_platform, load_pipeline_config, validate_dotted_names
    from vllm_omni.config.loader import visible_device_count
    from vllm_omni.config.support import check_devices_exist

    if stage_configs_path is not None and deploy_config is not None:
        raise ValueError("pass stage_configs_path (legacy stage_args YAML) or deploy_config, not both")
    path = stage_configs_path if stage_configs_path is not None else deploy_config
    fmt = "legacy" if stage_configs_path is not None else "deploy" if deploy_config is not None else None
    platform = detect_platform()
    pipeline = load_pipeline_config(path, model=model, expected_format=fmt, stage_overrides=stage_overrides,
                                    cli_args=engine_args or None, cli_stage_id=stage_id, platform=platform,
                                    output_modalities=output_modalities, check_devices=stage_id is None,
                                    async_chunk=async_chunk, strategy_config=strategy_config)
    num_devices = visible_device_count(platform)
    if stage_id is not None and num_devices is not None and stage_id in pipeline.stage_ids:
        check_devices_exist(pipeline.stage(stage_id), num_devices, lambda _path: pipeline.source)
    validate_dotted_names(pipeline)
    return pipeline


class OmniBase:
    """Starts the pipeline (stages load their models, so this blocks).

    `heartbeat_timeout`: seconds of silence after which a stage is declared down (its requests fail;
    it is back at once if it speaks again; killed and restarted after 3x as long); `max_stage_restarts`: restarts of a failed stage before it stays down (0: never).
    `lb_policy` (random, round-robin, least-queue-length): which replica of a stage with several
    (`num_replicas=N` for every stage, or runtime.num_replicas per stage) takes a new request.

    `output_modalities` (e.g. ["text"]): what this instance will ever return. With a bundled
    config it picks the smallest variant (text only: the thinker alone, no talker loaded), and
    it is the default of generate's `modalities`. `async_chunk` (None: the config's) makes
    the stages stream to each other (True) or hand over finished outputs only (False).

    `strategy_config`: upstream's parallel strategy file (tensor parallelism and replicas per
    model_stage, docs/compatibility.md); its stage_replica routing replaces `lb_policy`.

    `worker_backend="ray"` runs each stage as a Ray actor (needs the `ray` extra) on the Ray
    this process initialized, else the cluster at `ray_address`, else a local instance of its
    own (docs/deployment.md, "Ray").

    The stage-based CLI (docs/deployment.md): `stage_id` launches that stage only (engine
    arguments apply to it alone); headless stages register at `master_address:master_port`. Their
    links are authenticated and encrypted with the cluster secret (`omni_secret_file`, else the
    environment variable VLLM_OMNI_SECRET; without one the master listens on loopback only), and
    capped: `max_message_bytes` per message, `max_replicas_per_stage`, `registration_rate` per
    second (docs/operations.md, "Security: the stage transport").

    `media_policy`: where the media of prompts may come from and how much they may decode to
    (multimodal/media_policy.py; TRUSTED: any file or address, the default decode limits).

    `admission_policy` ("queue", "reject" or "off"), `admission_headroom`, `admission_max_wait`:
    new audio requests wait (or fail as overloaded) while the pipeline is at its playback load
    (engine/playback_admission.py, docs/streaming.md)."""

    def __init__(
        self,
        model: str | os.PathLike,
        stage_configs_path: str | None = None,
        deploy_config: str | None = None,
        stage_overrides: str | Mapping[Any, Any] | None = None,
        stage_init_timeout: float = 300,
        init_timeout: float = 600,
        shm_threshold_bytes: int = 65536,
        log_stats: bool = False,
        output_modalities: Sequence[str] | None = None,
        async_chunk: bool | None = None,
        heartbeat_timeout: float = 3.0,
        max_stage_restarts: int = 3,
        lb_policy: str = DEFAULT_LB_POLICY,
        worker_backend: str = "multi_process",
        ray_address: str | None = None,
        stage_id: int | None = None,
        master_address: str | None = None,
        master_port: int | None = None,
        media_policy: MediaPolicy = TRUSTED,
        omni_secret_file: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_replicas_per_stage: int = DEFAULT_MAX_REPLICAS_PER_STAGE,
        registration_rate: float = DEFAULT_REGISTRATION_RATE,
        strategy_config: str | os.PathLike | None = None,
        admission_policy: str = AdmissionOptions.policy,
        admission_headroom: float = AdmissionOptions.headroom,
        admission_max_wait: float = AdmissionOptions.max_wait_s,
        **engine_args: Any,
    ) -> None:
        model = os.fspath(model)
        if isinstance(output_modalities, str):
            output_modalities = [output_modalities]
        pipeline = load_pipeline(model, stage_configs_path, deploy_config, stage_overrides, engine_args,
                                 output_modalities, async_chunk, stage_id,
                                 None if strategy_config is None else os.fspath(strategy_config))
        if worker_backend == "multi_process" and any(s.runtime.process for s in pipeline.stages):
            check_main_module_guarded(type(self).__name__)  # before any stage starts
        options = RuntimeOptions(stage_init_timeout_s=float(stage_init_timeout), init_timeout_s=float(init_timeout),
                                 shm_threshold_bytes=int(shm_threshold_bytes), log_stats=log_stats,
                                 heartbeat_timeout_s=float(heartbeat_timeout),
                                 max_stage_restarts=int(max_stage_restarts), lb_policy=pipeline.lb_policy or lb_policy,
                                 worker_backend=worker_backend, ray_address=ray_address, local_stage=stage_id,
                                 master_address=master_address, master_port=master_port,
                                 cluster_keys=load_cluster_keys(omni_secret_file) if master_address else None,
                                 max_message_bytes=int(max_message_bytes),
                                 max_replicas_per_stage=int(max_replicas_per_stage),
                                 registration_rate=float(registration_rate),
                                 admission=AdmissionOptions(admission_policy, float(admission_headroom),
                                                            float(admission_max_wait)))
        self._runtime = OmniRuntime(pipeline, model, options, output_modalities, media_policy)

    @property
    def pipeline(self) -> PipelineConfig:
        return self._runtime.pipeline

    def get_tokenizer(self) -> Any:
        return self._runtime.tokenizer

    @property
    def output_modalities(self) -> list[str]:
        """What generate can return (the pipeline's final output types, e.g. ["text", "audio"])."""
        return self._runtime.default_modalities or available_modalities(self.pipeline)

    def stage_health(self) -> list[StageHealth]:
        """UP/DOWN (+ reason) per stage, for /health."""
        return self._runtime.health()

    def transport_drops(self) -> dict[DropKey, int]:
        """What this process's ends of the stage links dropped (by socket, stage, reason), for /metrics;
        the stages' own counts come with their stats."""
        return self._runtime.orchestrator.fleet.transport_drops()

    def stage_info(self, stage_id: int) -> StageInfo | None:
        """What stage `stage_id` reported when it came up: its engine's describe() (device,
        model settings; a video model's frame rate). None until a replica is up."""
        return self._runtime.orchestrator.pools[stage_id].info

    def close(self) -> None:
        self._runtime.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
