"""Driving the AR engine (`core.llm_engine.LLMEngine`) directly, as model tests do, with each
request's deltas folded into its whole `RequestOutput` the way the orchestrator folds a stage's
(`output_accumulator.OutputAccumulator`)."""
from __future__ import annotations

from typing import Any

from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.output_accumulator import OutputAccumulator
from vllm_omni.outputs import RequestOutput
from vllm_omni.sampling_params import SamplingParams


class EngineRun:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.accumulators: dict[str, OutputAccumulator] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any) -> bool:
        """`LLMEngine.add_request`; False when the request ended at once (an error output)."""
        early = self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
        # The prompt the engine runs: a stage model may lay out its own (a talker's).
        request = self.engine.scheduler.requests.get(request_id)
        ids = request.prompt_token_ids if request is not None else prompt_token_ids
        acc = self.accumulators[request_id] = OutputAccumulator(request_id, kwargs.get("prompt"), ids)
        if early is not None:
            acc.add(early)
        return early is None

    def step(self) -> list[RequestOutput]:
        """One engine step; -> the whole outputs of the requests it finished."""
        finished = []
        for out in self.engine.step():
            acc = self.accumulators[out.request_id]
            acc.add(out)
            if out.finished:
                finished.append(acc.output)
        return finished

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; -> request id -> its whole output."""
        while self.engine.has_unfinished_requests():
            self.step()
        return {rid: acc.output for rid, acc in self.accumulators.items()}
