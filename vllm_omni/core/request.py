"""Engine-side state of one request (vLLM v1 counters).

Prefill, chunked prefill, decode, prefix-cache hits and recompute after
preemption are all the same thing: compute tokens
`token_ids[num_computed_tokens : num_computed_tokens + n]`.
"""
from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.sampling_params import PLACEHOLDER_TOKEN, SamplingParams

if TYPE_CHECKING:
    from vllm_omni.core.detokenizer import IncrementalDetokenizer
    from vllm_omni.model_executor.models.stage_model import HiddenStateKey

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Started, holding its KV blocks, but its next position's input has not streamed in yet
    # (or it is paused): out of the batch until it can go on (upstream's WAITING_FOR_CHUNK).
    WAITING_FOR_INPUT = "waiting_for_input"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_INPUT)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        return_hidden_states: bool = False,
        model_inputs: Any = None,
        stream: bool = False,
        input_complete: bool = True,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if prompt_embeds is not None and prompt_embeds.shape[0] != len(prompt_token_ids):
            raise ValueError(
                f"request {request_id}: prompt_embeds has {prompt_embeds.shape[0]} rows "
                f"but the prompt has {len(prompt_token_ids)} tokens"
            )
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Rows replace the token embeddings of the prompt positions (a stage fed by another stage).
        self.prompt_embeds = prompt_embeds  # [num_prompt_tokens, hidden]
        self.return_hidden_states = return_hidden_states
        # Outputs every step (streaming consumers) or only when finished (LLM.generate).
        self.stream = stream
        # The model's typed per-request inputs (multimodal features, an upstream stage's hidden
        # states...), parsed once by StageModel.parse_request_inputs; None: plain tokens.
        self.model_inputs = model_inputs
        # Scratch space such a model may fill once per request (merged prompt embeddings,
        # M-RoPE positions); survives preemption because it depends only on the inputs.
        self.model_state: dict[str, Any] = {}
        self.arrival_order = next(_arrival_counter)
        # time.monotonic() of the request's phases (phase_durations)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # A request fed by a streaming edge starts before its input is complete: only positions
        # below `input_limit` have their inputs (None: all). Paused: its consumer is behind.
        self.input_complete = input_complete
        self.streamed_input = not input_complete  # its outputs report the input rows consumed
        self.input_limit: int | None = None
        self.paused = False

        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None

        self.generator: torch.Generator | None = None
        # Outputs are deltas: what the next output hands over (core.llm_engine._make_output).
        self.num_sent_tokens = 0  # output tokens already in an output
        self.unsent_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        # Captured hidden states not yet handed out, one chunk per computed span: key -> chunks;
        # `num_hidden_rows` positions have been captured (a recompute after preemption does not
        # capture them again).
        self.hidden_chunks: dict[HiddenStateKey, list[torch.Tensor]] = {}
        self.num_hidden_rows = 0
        self.detokenizer: IncrementalDetokenizer | None = None
        # The last entry of token_ids is PLACEHOLDER_TOKEN: sampled by the step in flight.
        self.has_placeholder = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def phase_durations(self) -> dict[str, float]:
        """Seconds from arrival to the first step that computed it (queue), from there to its first
        token (prefill) and from that token to now (decode): the phases it reached."""
        durations: dict[str, float] = {}
        if self.first_scheduled_time is not None:
            durations["queue"] = self.first_scheduled_time - self.arrival_time
            if self.first_token_time is not None:
                durations["prefill"] = self.first_token_time - self.first_scheduled_time
                durations["decode"] = time.monotonic() - self.first_token_time
        return durations

    @property
    def computable(self) -> bool:
        """The next position can be computed now (not paused, and its input is there)."""
        return not self.paused and (self.input_limit is None or self.num_computed_tokens < self.input_limit)

    def num_computable(self, num_new_tokens: int) -> int:
        """How many of the next `num_new_tokens` positions have their inputs."""
        if self.input_limit is None:
            return num_new_tokens
        return max(0, min(num_new_tokens, self.input_limit - self.num_computed_tokens))

    @property
    def cacheable(self) -> bool:
        """Prefix caching keys blocks by token ids only: requests whose KV depends on more
        (injected embeddings) or that must export every position's hidden states opt out."""
        return self.prompt_embeds is None and self.model_inputs is None and not self.return_hidden_states

    def append_output_token(self, token_id: int) -> None:
        """The next token; it takes the place of the placeholder when there is one."""
        if self.has_placeholder:
            self.token_ids[-1] = token_id
            self.has_placeholder = False
        else:
            self.token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """A token sampled on the device that the host has not read yet: the next step can be
        scheduled (and compute it) before it is known."""
        assert not self.has_placeholder, f"request {self.request_id}: two tokens in flight"
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.has_placeholder = True

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the KV cache, keep the tokens generated so far."""
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_hashed_blocks = 0
        self.status = RequestStatus.WAITING
