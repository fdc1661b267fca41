"""`Omni`: offline (blocking) generation through a multi-stage pipeline.

    with Omni(model="Qwen/Qwen2.5-Omni-7B") as omni:
        for out in omni.generate([{"messages": [{"role": "user", "content": "Hello"}]}]):
            print(out.stage_id, out.final_output_type, out.request_output.outputs[0].text)
        # out.final_output_type == "audio": out.request_output.outputs[0].multimodal_output["audio"]
        omni.generate(["Hello"], modalities=["text"])   # the thinker only

A plain LLM checkpoint with no stage config runs as a one-stage pipeline. Prompt shapes:
vllm_omni.inputs; output modalities and deltas: docs/architecture.md.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.orchestrator import RuntimeOptions
from vllm_omni.engine.request_plan import available_modalities
from vllm_omni.engine.request_state import RequestDone
from vllm_omni.engine.runtime import OmniRuntime
from vllm_omni.engine.stage_client import StageHealth
from vllm_omni.outputs import CompletionOutput, OmniRequestOutput, RequestOutput

logger = logging.getLogger(__name__)


def load_pipeline(model: str, stage_configs_path: str | None, deploy_config: str | None,
                  stage_overrides: str | Mapping[Any, Any] | None, engine_args: dict[str, Any],
                  output_modalities: Sequence[str] | None = None) -> PipelineConfig:
    """Parse every config input once (DESIGN 6) and check that its dotted names import."""
    from vllm_omni.config import detect_platform, load_pipeline_config, validate_dotted_names

    if stage_configs_path is not None and deploy_config is not None:
        raise ValueError("pass stage_configs_path (legacy stage_args YAML) or deploy_config, not both")
    path = stage_configs_path if stage_configs_path is not None else deploy_config
    fmt = "legacy" if stage_configs_path is not None else "deploy" if deploy_config is not None else None
    pipeline = load_pipeline_config(path, model=model, expected_format=fmt, stage_overrides=stage_overrides,
                                    cli_args=engine_args or None, platform=detect_platform(),
                                    output_modalities=output_modalities)
    validate_dotted_names(pipeline)
    return pipeline


def start_runtime(model: str | os.PathLike, stage_configs_path: str | None, deploy_config: str | None,
                  stage_overrides: Any, stage_init_timeout: float, init_timeout: float, shm_threshold_bytes: int,
                  log_stats: bool, engine_args: dict[str, Any],
                  output_modalities: Sequence[str] | None = None) -> OmniRuntime:
    model = os.fspath(model)
    if isinstance(output_modalities, str):
        output_modalities = [output_modalities]
    pipeline = load_pipeline(model, stage_configs_path, deploy_config, stage_overrides, engine_args,
                             output_modalities)
    options = RuntimeOptions(stage_init_timeout_s=float(stage_init_timeout), init_timeout_s=float(init_timeout),
                             shm_threshold_bytes=int(shm_threshold_bytes), log_stats=log_stats)
    return OmniRuntime(pipeline, model, options, output_modalities)


def failed_output(runtime: OmniRuntime, done: RequestDone) -> OmniRequestOutput:
    """A request that failed, as an output: `request_output.error` says why (and which stage)."""
    stage_id = done.failed_stage if done.failed_stage is not None else -1
    stage = next((s for s in runtime.pipeline.stages if s.stage_id == stage_id), None)
    kind = (stage or runtime.pipeline.final_stages[0]).final_output_type.value
    ro = RequestOutput(request_id=done.request_id, prompt=None, prompt_token_ids=[],
                       outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                       finished=True, error=done.error)
    return OmniRequestOutput(done.request_id, stage_id, kind, ro, finished=True)


class _QueueSink:
    wants_partial = False

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()

    def put(self, item: Any) -> None:
        self.queue.put(item)


class Omni:
    """`output_modalities` (e.g. ["text"]): what this instance will ever return. With a bundled
    config it picks the smallest variant (text only: the thinker alone, no talker loaded), and
    it is the default of generate's `modalities`."""

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
        **engine_args: Any,
    ) -> None:
        self._runtime = start_runtime(model, stage_configs_path, deploy_config, stage_overrides, stage_init_timeout,
                                      init_timeout, shm_threshold_bytes, log_stats, engine_args, output_modalities)
        self._ids = itertools.count()

    @property
    def pipeline(self) -> PipelineConfig:
        return self._runtime.pipeline

    def get_tokenizer(self) -> Any:
        return self._runtime.tokenizer

    @property
    def output_modalities(self) -> list[str]:
        """What generate can return (the pipeline's final output types, e.g. ["text", "audio"])."""
        return self._runtime.default_modalities or available_modalities(self.pipeline)

    def generate(
        self,
        prompts: Any,
        sampling_params_list: Sequence[Any] | None = None,
        *,
        py_generator: bool = False,
        use_tqdm: bool = True,
        modalities: Sequence[str] | None = None,
    ) -> list[OmniRequestOutput] | Iterator[OmniRequestOutput]:
        """One OmniRequestOutput per final-output stage per prompt, in prompt order; with
        `py_generator`, a generator that yields them as they finish. A failed request yields
        one output whose `request_output.error` names the stage that failed.

        `modalities` (e.g. ["text"]): return only these output types and run only the stages
        they need (None: the instance's output_modalities). Prompts: vllm_omni.inputs.
        Bad prompts, media or modalities raise ValueError before any request is queued."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        request_ids = [str(next(self._ids)) for _ in prompts]
        sink = _QueueSink()
        # Everything is validated before the first request is submitted.
        subs = [self._runtime.prepare(rid, p, sampling_params_list, sink, modalities)
                for rid, p in zip(request_ids, prompts)]
        outputs = self._stream(subs, sink, use_tqdm)
        if py_generator:
            return outputs
        order = {rid: i for i, rid in enumerate(request_ids)}
        return sorted(outputs, key=lambda o: (order[o.request_id], o.stage_id))

    def _stream(self, subs: list[Any], sink: _QueueSink, use_tqdm: bool) -> Iterator[OmniRequestOutput]:
        pending = {sub.request_id for sub in subs}
        bar = tqdm(total=len(subs), desc="Processed prompts", disable=not use_tqdm)
        try:
            for sub in subs:
                self._runtime.submit(sub)
            while pending:
                # No timeout needed: the orchestrator ends every request (stage deadlines), and
                # delivers a failure to every waiter if its loop ever stops.
                item = sink.queue.get()
                if isinstance(item, RequestDone):
                    pending.discard(item.request_id)
                    bar.update(1)
                    if item.error is not None:
                        yield failed_output(self._runtime, item)
                    continue
                yield item
        finally:
            bar.close()
            if pending and not self._runtime.closed:  # the caller stopped early: free the stages
                for request_id in pending:
                    self._runtime.abort(request_id)

    def stage_health(self) -> list[StageHealth]:
        """UP/DOWN (+ reason) per stage, for /health."""
        return self._runtime.health()

    def get_stage_stats(self, stage_id: int) -> StageStats:
        """Ask a stage for its counters (unfinished requests, free KV blocks, ...)."""
        return self._runtime.stage_stats(stage_id)

    def close(self) -> None:
        self._runtime.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
