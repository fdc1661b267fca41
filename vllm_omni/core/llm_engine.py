"""The autoregressive engine: add requests, step, abort.

One `step()` schedules a batch, runs it, appends sampled tokens, applies the stop
rules and returns a `StageOutput` for every request that produced a token or finished. An
output is a delta, as vLLM v1's engine core emits: the token ids, text, logprobs and tensor
rows new since the request's previous output (a request added with `stream=False` makes one
output, at finish, which then holds everything). Nothing here accumulates: readers fold the
deltas with `output_accumulator.OutputAccumulator`. Everything here runs in the caller's
thread; stage workers and the `LLM` class drive it.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig

from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from vllm_omni.core.detokenizer import IncrementalDetokenizer
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.kv_cache_sizing import plan_kv_cache
from vllm_omni.model_executor.dtypes import torch_dtype
from vllm_omni.model_executor.model_loader import load_hf_config, load_model
from vllm_omni.model_executor.models.stage_model import StageModel, hidden_state_name
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageOutput
from vllm_omni.core.model_runner import ARModelRunner, PendingTokens, StepHiddenStates
from vllm_omni.core.tp_executor import TPExecutor
from vllm_omni.core.isolated_step import execute_isolating_failures

logger = logging.getLogger(__name__)


def max_tokens_too_large(max_tokens: int, max_model_len: int, prompt_tokens: int) -> str:
    """vLLM's server's wording (clients parse it), for a request's own max_tokens that does not
    fit the context after its prompt; the API server answers it with a 400 (openai/errors.py)."""
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens ({max_tokens} > "
            f"{max_model_len} - {prompt_tokens}).")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class _InFlight:
    """A step launched under async scheduling whose outputs the host has not read yet."""

    tokens: PendingTokens
    hidden_states: StepHiddenStates
    spans: list[tuple[Request, int, int]]  # (request, end of its computed positions, how many this step computed)


class LLMEngine:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.hf_config = hf_config or load_hf_config(config.model)
        self.dtype = torch_dtype(config.dtype, self.hf_config)
        torch.manual_seed(config.seed)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.eos_token_ids = self._eos_token_ids()

        # Tensor parallel: rank 0 of N; the executor runs the other ranks and stands in for the runner.
        tp = TPExecutor(config, self.hf_config, self.dtype, self.device) if config.tensor_parallel_size > 1 else None
        self.model: StageModel = tp.model if tp is not None else load_model(
            config.model, self.hf_config, self.dtype, self.device, config.architecture, config.model_stage,
            config.load_format, dict(config.predictor_sampling), config.num_weight_load_threads,
        )
        # A stage model whose vocabulary is not the tokenizer's (a talker's codec) names its own EOS.
        self.eos_token_ids = self.model.eos_token_ids or self.eos_token_ids
        self.vocab_size: int = self.model.vocab_size
        plan = tp.plan if tp is not None else plan_kv_cache(config, self.model, self.dtype, self.device)
        self.max_model_len = plan.max_model_len
        self.runner = tp if tp is not None else ARModelRunner(
            self.model,
            device=self.device,
            dtype=self.dtype,
            block_size=config.block_size,
            num_blocks=plan.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            hidden_state_layers=config.hidden_state_layers,
            enforce_eager=config.enforce_eager,
        )
        self.block_manager = BlockManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
        # Async scheduling (config.async_scheduling): the step whose tokens are still on the device.
        self._async = config.async_scheduling and isinstance(self.runner, ARModelRunner)
        self._pending: _InFlight | None = None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.enable_chunked_prefill, audio_seconds_per_token=self.model.audio_seconds_per_token),
            self.block_manager,
        )
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d",
            config.model, self.device, self.dtype, plan.num_blocks, config.block_size, self.max_model_len,
        )

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        try:
            gen = GenerationConfig.from_pretrained(self.config.model)
            eos = gen.eos_token_id
            ids.extend([eos] if isinstance(eos, int) else list(eos or []))
        except OSError:
            pass  # no generation_config.json: the tokenizer's EOS alone
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.insert(0, self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    # --- requests -------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        return_hidden_states: bool = False,
        model_inputs: Mapping[str, Any] | None = None,
        stream: bool = False,
        input_complete: bool = True,
    ) -> StageOutput | None:
        """Queue a request. Returns a finished error output instead when the request cannot
        run at all (e.g. its prompt is longer than max_model_len); other requests are unaffected.

        `model_inputs` (a stage's additional_information) are parsed once, here, by the model
        (StageModel.parse_request_inputs): a ValueError means a bad request and is raised.
        `stream`: an output (a delta) every step that sampled, else one output when finished.
        `input_complete=False`: more inputs stream in (`append_inputs`); the request computes
        what its inputs allow and waits for the rest."""
        params = params.clone(_eos_token_ids=self.eos_token_ids)
        inputs = self.model.parse_request_inputs(model_inputs or {})
        prompt_token_ids = self.model.prompt_token_ids(prompt_token_ids, inputs)
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            prompt_embeds=prompt_embeds,
            return_hidden_states=return_hidden_states,
            model_inputs=inputs,
            stream=stream,
            input_complete=input_complete,
        )
        bad_id = self._out_of_vocab(prompt_token_ids)
        if bad_id is not None:
            request.error = (f"request {request_id}: prompt token id {bad_id} is not in the vocabulary "
                             f"(ids 0..{self.vocab_size - 1})")
            request.status = RequestStatus.FINISHED_ERROR
            return self._make_output(request)
        if not input_complete:
            request.input_limit = self.model.available_positions(request)
        if request.num_prompt_tokens >= self.max_model_len:
            request.error = (
                f"request {request_id}: the prompt has {request.num_prompt_tokens} tokens, which does not "
                f"leave room for one output token within max_model_len={self.max_model_len}"
            )
        elif params._max_tokens_must_fit and request.num_prompt_tokens + (params.max_tokens or 0) > self.max_model_len:
            request.error = max_tokens_too_large(params.max_tokens, self.max_model_len, request.num_prompt_tokens)
        elif not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            request.error = (
                f"request {request_id}: the prompt has {request.num_prompt_tokens} tokens, more than one step's "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}, and enable_chunked_prefill is off"
            )
        if request.error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            return self._make_output(request)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(params.seed)
        if self.tokenizer is not None and params.detokenize:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        self.scheduler.add_request(request)
        return None

    def append_inputs(self, request_id: str, inputs: Mapping[str, Any], final: bool) -> None:
        """More input for a request whose input streams in (StageModel.append_request_inputs).
        Unknown ids are ignored (finished or aborted meanwhile); ValueError: bad input."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        if request.input_complete:
            raise ValueError(f"request {request_id}: its input is already complete")
        self.model.append_request_inputs(request, inputs, final)
        request.input_complete = final
        request.input_limit = None if final else self.model.available_positions(request)
        self.scheduler.wake(request)

    def pause_requests(self, request_ids: list[str], paused: bool) -> None:
        """Flow control: a paused request is not scheduled (it keeps its KV blocks)."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                request.paused = paused
                self.scheduler.wake(request)

    def _out_of_vocab(self, token_ids: list[int]) -> int | None:
        """The first id the model cannot embed (the whole batch's step would fail on it), or None."""
        return next((t for t in token_ids if not 0 <= t < self.vocab_size), None)

    def abort_request(self, request_ids: list[str] | str) -> list[StageOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._make_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        self.runner.check_health()  # a dead tensor-parallel rank fails the engine even when idle
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """A step now would compute something (requests waiting for streamed input do not)."""
        self.runner.check_health()  # a dead tensor-parallel rank fails the engine even when idle
        return self._pending is not None or self.scheduler.has_work()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # --- stepping -------------------------------------------------------------
    def step(self) -> list[StageOutput]:
        """One step. Under async scheduling a step's sampled tokens stay on the device until the
        next step is launched: that step reads them there, and only then does the host read them
        (stop rules, outputs). Outputs lag one step; the host's scheduling and input preparation
        run while the GPU computes the step before."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self._pending is None and self.scheduler.has_work():
                # Cannot happen while the pool holds one max_model_len request (checked at start).
                raise RuntimeError("scheduler made no progress with computable requests")
            return self._settle_pending()
        previous = self._pending.tokens if self._pending is not None else None
        try:
            result, failures = execute_isolating_failures(self.runner, sched, previous, self._async)
        except Exception:
            with contextlib.suppress(Exception):  # no placeholder outlives its step (the error goes on)
                self._settle_pending()
            raise
        outputs = self._fail_requests(sched, failures) if failures else []
        # The tokens of the step before (they may end requests that this step computed for nothing).
        outputs += self._settle_pending()
        sched.scheduled = [item for item in sched.scheduled if not item.request.status.finished]
        self.scheduler.advance(sched)
        # (request, its computed positions' end, how many this step computed), for hidden states
        spans = [(item.request, item.request.num_computed_tokens, item.num_new_tokens) for item in sched.scheduled]
        if result.pending is not None:
            for request in result.pending.requests:
                if request.status.finished:
                    continue
                if not self._at_length_limit(request, in_flight=1):  # else no step is scheduled for it
                    request.append_placeholder()  # the next step computes it (read from the device)
            self._pending = _InFlight(result.pending, result.hidden_states, spans)
            return outputs
        for request, end, num_new_tokens in spans:
            self._collect_hidden_states(request, end, num_new_tokens, result.hidden_states)
        for item in sched.scheduled:
            request = item.request
            token = result.sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            self._append_token(request, token, result.logprobs.get(request.request_id))
            if request.stream or request.status.finished:
                outputs.append(self._make_output(request))
        return outputs

    def _settle_pending(self) -> list[StageOutput]:
        """Read the deferred step's hidden states and tokens: each token takes its placeholder's
        place, then the stop rules."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        for request, end, num_new_tokens in pending.spans:
            if not request.status.finished:
                self._collect_hidden_states(request, end, num_new_tokens, pending.hidden_states)
        result = pending.tokens.result()
        outputs = []
        for request, token, logprobs in zip(pending.tokens.requests, result.token_ids, result.logprobs):
            if request.status.finished:
                continue  # aborted or failed meanwhile
            self._append_token(request, token, logprobs)
            if request.stream or request.status.finished:
                outputs.append(self._make_output(request))
        return outputs

    def _at_length_limit(self, request: Request, in_flight: int = 0) -> bool:
        """max_model_len or max_tokens reached, counting `in_flight` tokens not appended yet."""
        max_tokens = request.sampling_params.max_tokens
        return request.num_tokens + in_flight >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens + in_flight >= max_tokens)

    def _fail_requests(self, sched: SchedulerOutput, failures: dict[str, str]) -> list[StageOutput]:
        """End the requests that broke the step; the rest of `sched` goes on as scheduled."""
        outputs = []
        for item in [item for item in sched.scheduled if item.request.request_id in failures]:
            request = item.request
            logger.warning("request %s failed: %s", request.request_id, failures[request.request_id])
            request.error = failures[request.request_id]
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            sched.scheduled.remove(item)
            outputs.append(self._make_output(request))
        return outputs

    def _collect_hidden_states(self, request: Request, end: int, num_new_tokens: int,
                               hidden_states: StepHiddenStates) -> None:
        """The rows of positions end - num_new_tokens .. end - 1, computed by a step, if exported."""
        states = hidden_states.of(request.request_id)
        if not states:
            return
        # Rows of positions captured before (a recompute after preemption) are not captured twice.
        skip = max(0, request.num_hidden_rows - (end - num_new_tokens))
        if skip >= num_new_tokens:
            return
        for key, chunk in states.items():
            request.hidden_chunks.setdefault(key, []).append(chunk[skip:])
        request.num_hidden_rows = end

    def _append_token(self, request: Request, token: int, logprobs: dict[int, float] | None) -> None:
        request.append_output_token(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if logprobs is not None:
            request.unsent_logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token]
        status = self._stop_by_token(request, token)
        if request.detokenizer is not None:
            # A token that stopped the request is not part of the text (vLLM does the same).
            stop_str = request.detokenizer.append([token], stop_terminated=status is RequestStatus.FINISHED_STOPPED)
            if stop_str is not None and status is not RequestStatus.FINISHED_STOPPED:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is not None:
            self.scheduler.finish(request, status)

    def _stop_by_token(self, request: Request, token: int) -> RequestStatus | None:
        """vLLM's order: a stop token ends the request as "stop" even when it is also the last
        token the length allows (a talker's EOS there is not a code: downstream stages drop it)."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in params._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, request: Request) -> StageOutput:
        """What the request made since its previous output (everything, for its only output
        when it does not stream)."""
        finished = request.status.finished
        sent = request.num_prompt_tokens + request.num_sent_tokens
        settled = request.num_tokens - request.has_placeholder
        request.num_sent_tokens = settled - request.num_prompt_tokens
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs, request.unsent_logprobs = request.unsent_logprobs, []
        multimodal_output: dict[str, torch.Tensor] = {}
        if request.error is None and request.hidden_chunks:
            # Typed keys inside the engine; spec 003's string keys ("0", "24", "last") outside.
            multimodal_output = {hidden_state_name(key): torch.cat(chunks)
                                 for key, chunks in request.hidden_chunks.items()}
            request.hidden_chunks = {}
        if request.error is None:
            multimodal_output.update(self.model.request_outputs(request, finished))
        return StageOutput(
            request_id=request.request_id,
            finished=finished,
            new_token_ids=request.token_ids[sent:settled],
            # A stop string found later may still cut the text's tail: it waits (detokenizer.py).
            new_text=request.detokenizer.take_delta(final=finished) if request.detokenizer is not None else "",
            new_logprobs=logprobs,
            cumulative_logprob=request.cumulative_logprob if logprobs is not None else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            multimodal_output=multimodal_output,
            error=request.error,
            # A request whose input streams in consumed one input row per output token.
            consumed_units=request.num_sent_tokens if request.streamed_input else None,
            num_cached_tokens=request.num_cached_tokens,
            # The phases it went through here (a stage's profiler names them: ar_stage_engine.py).
            stage_durations=request.phase_durations() if finished else None,
        )
