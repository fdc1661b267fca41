"""The autoregressive engine: add requests, step, abort.

One `step()` schedules a batch, runs it, appends sampled tokens, applies the stop
rules and returns a `RequestOutput` for every request that produced a token or
finished. Everything here runs in the caller's thread; stage workers and the
`LLM` class drive it.
"""
from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from vllm_omni.core.detokenizer import IncrementalDetokenizer
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.kv_cache_sizing import plan_kv_cache
from vllm_omni.model_executor.model_loader import load_model, resolve_dtype
from vllm_omni.outputs import CompletionOutput, RequestOutput
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.core.model_runner import ARModelRunner, RunnerOutput
from vllm_omni.core.isolated_step import execute_isolating_failures

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.hf_config = hf_config or AutoConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(self.hf_config, config.dtype)
        torch.manual_seed(config.seed)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.eos_token_ids = self._eos_token_ids()

        self.model = load_model(
            config.model, self.hf_config, self.dtype, self.device, config.architecture, config.model_stage,
            config.load_format,
        )
        # Optional model hook: finished_request_outputs(request) -> {key: CPU tensor}, what the
        # model made for a request besides tokens (Qwen3-Omni's talker: its codec frames), added
        # to the finished request's multimodal_output.
        self.model_request_outputs = getattr(self.model, "finished_request_outputs", None)
        # A stage model whose vocabulary is not the tokenizer's (a talker's codec) names its own EOS.
        self.eos_token_ids = tuple(getattr(self.model, "eos_token_ids", ()) or self.eos_token_ids)
        # The rows of the model's input embedding (a talker's codec vocabulary, not the tokenizer's).
        self.vocab_size: int | None = getattr(self.model, "vocab_size", None)
        plan = plan_kv_cache(config, self.model, self.hf_config, self.dtype, self.device)
        self.max_model_len = plan.max_model_len
        self.runner = ARModelRunner(
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
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
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
        model_inputs: dict | None = None,
        stream: bool = True,
    ) -> RequestOutput | None:
        """Queue a request. Returns a finished error output instead when the request cannot
        run at all (e.g. its prompt is longer than max_model_len); other requests are unaffected."""
        params = params.clone(_eos_token_ids=self.eos_token_ids)
        if model_inputs and hasattr(self.model, "prepare_prompt_token_ids"):  # model-owned prompt layout
            prompt_token_ids = self.model.prepare_prompt_token_ids(prompt_token_ids, model_inputs)
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            prompt_embeds=prompt_embeds,
            return_hidden_states=return_hidden_states,
            model_inputs=model_inputs,
            stream=stream,
        )
        bad_id = self._out_of_vocab(prompt_token_ids)
        if bad_id is not None:
            request.error = (f"request {request_id}: prompt token id {bad_id} is not in the vocabulary "
                             f"(ids 0..{self.vocab_size - 1})")
            request.status = RequestStatus.FINISHED_ERROR
            return self._make_output(request)
        if request.num_prompt_tokens >= self.max_model_len:
            request.error = (
                f"request {request_id}: the prompt has {request.num_prompt_tokens} tokens, which does not "
                f"leave room for one output token within max_model_len={self.max_model_len}"
            )
            request.status = RequestStatus.FINISHED_ERROR
            return self._make_output(request)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(params.seed)
        if self.tokenizer is not None and params.detokenize:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        self.scheduler.add_request(request)
        return None

    def _out_of_vocab(self, token_ids: list[int]) -> int | None:
        """The first id the model cannot embed (the whole batch's step would fail on it), or None."""
        if self.vocab_size is None:
            return None
        return next((t for t in token_ids if not 0 <= t < self.vocab_size), None)

    def abort_request(self, request_ids: list[str] | str) -> list[RequestOutput]:
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
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # --- stepping -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                # Cannot happen while the pool holds one max_model_len request (checked at start).
                raise RuntimeError("scheduler made no progress with unfinished requests")
            return []
        result, failures = execute_isolating_failures(self.runner, sched)
        outputs = self._fail_requests(sched, failures) if failures else []
        self.scheduler.advance(sched)
        for item in sched.scheduled:
            request = item.request
            self._collect_hidden_states(request, result)
            token = result.sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            self._append_token(request, token, result)
            if request.stream or request.status.finished:
                outputs.append(self._make_output(request))
        return outputs

    def _fail_requests(self, sched: SchedulerOutput, failures: dict[str, str]) -> list[RequestOutput]:
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

    def _collect_hidden_states(self, request: Request, result: RunnerOutput) -> None:
        for key, chunk in result.hidden_states.get(request.request_id, {}).items():
            request.hidden_chunks.setdefault(key, []).append(chunk)

    def _append_token(self, request: Request, token: int, result: RunnerOutput) -> None:
        request.append_output_token(token)
        logprobs = result.logprobs.get(request.request_id)
        if logprobs is not None:
            request.logprobs.append(logprobs)
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
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token in params._eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def _make_output(self, request: Request) -> RequestOutput:
        finished = request.status.finished
        params = request.sampling_params
        completion = CompletionOutput(
            index=0,
            text=request.detokenizer.output_text if request.detokenizer is not None else "",
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(request.logprobs) if params.logprobs is not None else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )
        if finished and request.error is None and request.hidden_chunks:
            completion.multimodal_output = {key: torch.cat(chunks) for key, chunks in request.hidden_chunks.items()}
        if finished and request.error is None and self.model_request_outputs is not None:
            completion.multimodal_output.update(self.model_request_outputs(request))
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
        )
