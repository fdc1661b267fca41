"""`OmniRuntime`: hosts the orchestrator on its own thread and event loop.

Both `Omni` (sync) and `AsyncOmni` talk to it. A dedicated loop keeps bridges and
routing off the caller's loop, and the thread that spawns the stage processes lives
exactly as long as the pipeline, which matters because a child's parent-death signal
fires when the spawning *thread* exits. Closing is idempotent and also runs at exit.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from vllm_omni.config.stage_config import PipelineConfig, StageConfig, WorkerType
from vllm_omni.engine.orchestrator import Orchestrator, RuntimeOptions, Submission
from vllm_omni.engine.pipeline_sleep import PipelineSleepingError
from vllm_omni.engine.request_plan import check_modalities, plan_request
from vllm_omni.engine.request_state import RequestSink
from vllm_omni.engine.serving_stalls import StepWatch
from vllm_omni.engine.stage_client import StageHealth
from vllm_omni.engine.stage_init_utils import prepare_engine_environment
from vllm_omni.engine.stage_worker import IN_PROCESS_INIT
from vllm_omni.engine.messages import StageStats
from vllm_omni.inputs import needs_input_processing, parse_prompt
from vllm_omni.multimodal.media_policy import TRUSTED, MediaPolicy
from vllm_omni.sampling_params import DiffusionSamplingParams, InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)

_START_MARGIN_S = 60.0  # teardown after a failed start, beyond init_timeout
LOOP_TICK_S = 1.0  # how often the orchestrator's loop proves it turns (to its StepWatch)


class OmniRuntime:
    def __init__(self, pipeline: PipelineConfig, model: str, options: RuntimeOptions,
                 output_modalities: Sequence[str] | None = None, media_policy: MediaPolicy = TRUSTED) -> None:
        prepare_engine_environment()
        self.pipeline = pipeline
        self.model = model
        self.options = options
        # The modalities a request gets when it names none (None: every final output).
        self.default_modalities = check_modalities(pipeline, output_modalities)
        self._tokenizer: Any = None
        self._input_processor: Any = None
        # Prompts are processed in the callers' threads at once (AsyncOmni: a worker thread per
        # request); each input processor keeps its tokenizer under a lock of its own, and media
        # are fetched and decoded outside it (multimodal/input_processors.py).
        self._media_policy = media_policy
        self._closed = False
        self.orchestrator = Orchestrator(pipeline, model, options)  # validates before anything starts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-omni-orchestrator", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.orchestrator.start(), self._loop)
        try:
            # The caller's half of the startup runs while the stages load their models; not
            # while a stage in this process does (IN_PROCESS_INIT: imports are not thread-safe).
            in_process = not all(s.runtime.process for s in pipeline.stages)
            with IN_PROCESS_INIT if in_process else contextlib.nullcontext():
                self._input_processor = self._load_input_processor()
        except BaseException:
            self._abandon_start(future)
            raise
        try:
            future.result(timeout=options.init_timeout_s + _START_MARGIN_S)
        except BaseException:
            self._stop_loop()
            raise
        atexit.register(self.close)

    def _abandon_start(self, future: Any) -> None:
        # Let the start finish (or fail) so that close() meets stages in a known state.
        try:
            future.result(timeout=self.options.init_timeout_s + _START_MARGIN_S)
        except BaseException:  # noqa: BLE001 - the caller's own error is the one to report
            self._stop_loop()
            return
        self.close()

    def _load_input_processor(self) -> Any:
        """The entry stage's input processor, by its model architecture (multimodal.input_processors)."""
        from vllm_omni.config.bundled import read_hf_config
        from vllm_omni.multimodal.input_processors import TextInputProcessor, get_input_processor

        entry = self.pipeline.entry_stages[0]
        path = entry.engine_args.model or self.model
        if entry.worker_type == WorkerType.DIFFUSION:
            from vllm_omni.multimodal.diffusion_prompt import DiffusionPromptProcessor

            return DiffusionPromptProcessor(model_name=path, media=self._media_policy)
        hf_config = read_hf_config(path) if (Path(path) / "config.json").is_file() else None
        if hf_config is None:  # e.g. a hub id resolved by the stage itself: text prompts only
            return TextInputProcessor(self.tokenizer, model_name=path)
        return get_input_processor(path, hf_config, self.tokenizer, architecture=entry.engine_args.model_arch,
                                   media=self._media_policy)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        # A loop that stops turning (a blocking call in a callback) holds every request while the
        # stages go on: a minute without its tick, and every thread's stack goes to the log.
        watch = StepWatch("the orchestrator's loop")

        def tick() -> None:
            watch.started = time.monotonic()
            self._loop.call_later(LOOP_TICK_S, tick)

        self._loop.call_soon(tick)
        try:
            self._loop.run_forever()
        finally:
            watch.close()
            # Whatever stopped the loop, no caller may keep waiting for an output.
            self.orchestrator.fail_all("the orchestrator stopped")
            self._loop.close()

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.options.shutdown_timeout_s)

    # --- requests (any thread) ------------------------------------------------
    def prepare(self, request_id: str, prompt: Any, sampling_params_list: Any, sink: RequestSink,
                modalities: Sequence[str] | None = None, input_complete: bool = True) -> Submission:
        """Validate and process a prompt in the caller's thread (chat template, media, features);
        raises ValueError on bad input, before anything is queued."""
        if self.is_sleeping:
            raise PipelineSleepingError()
        if not input_complete:
            self._check_streamed_input()
        plan = plan_request(self.pipeline, modalities if modalities is not None else self.default_modalities)
        params = self.resolve_params(sampling_params_list)
        parsed = parse_prompt(prompt)
        diffusion = self.pipeline.entry_stages[0].worker_type == WorkerType.DIFFUSION  # text only, always processed
        if "prompt_token_ids" in parsed and not needs_input_processing(parsed) and not diffusion:
            processed = parsed  # nothing to do
        else:
            processed = self._input_processor.process(parsed)
        ids = list(processed["prompt_token_ids"])
        self._check_prompt_ids(ids)
        return Submission(request_id, processed, ids, params, sink, plan, input_complete)

    def _check_streamed_input(self) -> None:
        entry = self.pipeline.entry_stages[0]
        info = self.orchestrator.pools[entry.stage_id].info
        if info is None or not info.accepts_streamed_input:
            raise ValueError(f"stage {entry.stage_id} of this model takes its input whole (input_complete must "
                             "be true)")

    def process_delta(self, delta: Any) -> dict[str, Any]:
        """More input of a request submitted with input_complete=False -> the entry stage's chunk
        (its input processor's `process_delta`; ValueError on bad input)."""
        return self._input_processor.process_delta(delta) if delta else {}  # it guards its tokenizer

    def append_input(self, request_id: str, info: dict[str, Any], final: bool) -> None:
        self._call_soon(self.orchestrator.append_input, request_id, info, final)

    def _check_prompt_ids(self, ids: list[int]) -> None:
        """Token ids the entry stage cannot embed are the caller's error (400), found before queuing.
        Only a token-consuming entry stage (an AR engine, which reports its vocab_size) checks them:
        a diffusion stage takes the prompt's text."""
        entry = self.pipeline.entry_stages[0]
        info = self.orchestrator.pools[entry.stage_id].info
        vocab = info.vocab_size if info is not None else None
        if vocab is None:
            return
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"prompt token id {bad!r} is not in the vocabulary of stage "
                                             f"{entry.stage_id} (token ids are 0..{vocab - 1})")

    def submit(self, sub: Submission) -> None:
        self._call_soon(self.orchestrator.submit, sub)

    def abort(self, request_id: str) -> None:
        self._call_soon(self.orchestrator.abort, request_id)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the Omni pipeline is closed")
        self._loop.call_soon_threadsafe(fn, *args)

    def resolve_params(self, sampling_params_list: Any) -> list[SamplingParams]:
        """One SamplingParams per stage: the stage defaults, overridden per request.

        Accepts None, a list with one entry per stage (SamplingParams, a dict of fields
        that override the stage default, or None for the default), or a single
        SamplingParams when the pipeline has one stage.
        """
        stages = self.pipeline.stages
        if sampling_params_list is None:
            return [s.new_sampling_params() for s in stages]
        if isinstance(sampling_params_list, (SamplingParams, DiffusionSamplingParams, dict)):
            sampling_params_list = [sampling_params_list]
        if not isinstance(sampling_params_list, Sequence) or len(sampling_params_list) != len(stages):
            n = len(sampling_params_list) if isinstance(sampling_params_list, Sequence) else 1
            raise ValueError(f"sampling_params_list has {n} entries; the pipeline has {len(stages)} stages "
                             "(one entry per stage, None for a stage's defaults)")
        out = []
        for stage, item in zip(stages, sampling_params_list):
            if stage.worker_type == WorkerType.DIFFUSION:
                out.append(_diffusion_params(stage, item))
            elif item is None:
                out.append(stage.new_sampling_params())
            elif isinstance(item, SamplingParams):
                out.append(item)
            elif isinstance(item, dict):
                defaults = {k: v for k, v in vars(stage.default_sampling_params).items() if not k.startswith("_")}
                out.append(SamplingParams.from_dict({**defaults, **item}, where=f"stage {stage.stage_id} sampling params"))
            else:
                raise ValueError(f"stage {stage.stage_id}: sampling params must be SamplingParams, a dict or None, "
                                 f"got {type(item).__name__}")
        return out

    @property
    def tokenizer(self) -> Any:
        """The first comprehension stage's tokenizer (None when no stage is one); loaded on first use."""
        stage = self.pipeline.comprehension_stage
        if self._tokenizer is None and stage is not None:
            from vllm_omni.model_executor.model_loader import load_tokenizer

            ea = stage.engine_args
            self._tokenizer = load_tokenizer(ea.tokenizer or ea.model or self.model)
        return self._tokenizer

    # --- introspection --------------------------------------------------------
    def health(self) -> list[StageHealth]:
        # A snapshot of plain attributes that only the loop thread writes: no round trip needed,
        # so /health answers even when the loop is busy.
        return self.orchestrator.fleet.health()

    def stage_stats(self, stage_id: int) -> StageStats:
        timeout = self.options.heartbeat_timeout_s
        return self._run(self.orchestrator.fleet.stage_stats(stage_id, timeout), timeout + 1.0)

    async def stage_stats_async(self, stage_id: int) -> StageStats:
        timeout = self.options.heartbeat_timeout_s
        return await self._on_loop(self.orchestrator.fleet.stage_stats(stage_id, timeout), timeout + 1.0)

    # --- sleep mode (engine/pipeline_sleep.py) --------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.orchestrator.sleep_mode.sleeping

    def sleep(self, level: int) -> None:
        self._run(self.orchestrator.sleep(level), self._sleep_timeout_s)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._run(self.orchestrator.sleep_mode.wake_up(tags), self._sleep_timeout_s)

    async def sleep_async(self, level: int) -> None:
        await self._on_loop(self.orchestrator.sleep(level), self._sleep_timeout_s)

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        await self._on_loop(self.orchestrator.sleep_mode.wake_up(tags), self._sleep_timeout_s)

    @property
    def _sleep_timeout_s(self) -> float:
        # The stages answer in parallel; a failed sleep wakes them again (a second round).
        return 2 * self.options.stage_init_timeout_s + 5.0

    async def _on_loop(self, coro: Any, timeout_s: float) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("the Omni pipeline is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def _run(self, coro: Any, timeout_s: float) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("the Omni pipeline is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"the orchestrator did not answer within {timeout_s}s") from None

    @property
    def closed(self) -> bool:
        return self._closed

    # --- shutdown -------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self.orchestrator.close(), self._loop)
            budget = 3 * self.options.shutdown_timeout_s + 5.0  # Shutdown, SIGTERM and SIGKILL waits
            try:
                future.result(budget)
            except FutureTimeout:
                logger.error("the pipeline did not shut down within %ss; killing its stages", budget)
            except Exception:  # noqa: BLE001 - still stop the loop and the stages below
                logger.exception("shutting the pipeline down failed; killing its stages")
        self._stop_loop()
        # If the loop died or timed out, make sure no stage process outlives us.
        for client in self.orchestrator.fleet.all_clients():
            client.launcher.stop_blocking(self.options.shutdown_timeout_s)


def _diffusion_params(stage: StageConfig, item: Any) -> DiffusionSamplingParams:
    """A diffusion stage's request parameters: DiffusionSamplingParams, or a dict of fields
    that override the stage defaults, or None for the defaults."""
    if item is None:
        return stage.new_sampling_params()
    if isinstance(item, DiffusionSamplingParams):
        return item
    if isinstance(item, dict):
        return DiffusionSamplingParams.from_dict({**stage.default_sampling_params.to_dict(), **item},
                                                 where=f"stage {stage.stage_id} sampling params")
    raise ValueError(f"stage {stage.stage_id} is a diffusion stage: its sampling params must be "
                     f"DiffusionSamplingParams, a dict or None, got {type(item).__name__}")
