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
import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.engine.messages import StageStats
from vllm_omni.engine.request_state import RequestDone
from vllm_omni.engine.runtime import OmniRuntime
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.outputs import CompletionOutput, OmniRequestOutput, RequestOutput, RequestOutputKind

logger = logging.getLogger(__name__)


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
    output_kind = RequestOutputKind.FINAL_ONLY

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()

    def put(self, item: Any) -> None:
        self.queue.put(item)


class Omni(OmniBase):
    """Blocking generation; constructor arguments: `OmniBase`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ids = itertools.count()

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

    def get_stage_stats(self, stage_id: int) -> StageStats:
        """Ask a stage for its counters (unfinished requests, free KV blocks, ...)."""
        return self._runtime.stage_stats(stage_id)

    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep`: the stages in sleep mode (`enable_sleep_mode`) free their device memory;
        level 1 keeps the weights in CPU memory, level 2 drops them (docs/operations.md, "Sleep mode").
        Raises SleepConflict while requests are in flight."""
        self._runtime.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: `tags` ("weights", "kv_cache"; None: both) wake those parts."""
        self._runtime.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._runtime.is_sleeping
