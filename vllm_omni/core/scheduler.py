"""Continuous-batching scheduler (vLLM v1 shape).

Each step shares one token budget (`max_num_batched_tokens`) between running
requests (decode or the rest of a chunked prefill) and waiting requests (FCFS),
with at most `max_num_seqs` running. When the KV pool runs dry, the most recently
arrived running request is preempted and later recomputed.

A request whose input streams in (a streaming edge) can catch up with its upstream stage:
its next position has no input yet (or it is paused by flow control). It then leaves the
batch for `waiting_for_input`, keeping its KV blocks but not its batch slot, and comes back
(before any new request) once `wake()` finds it computable. Such requests are the first
preempted when the pool runs dry: they hold memory and do no work.

A talker whose tokens become audio downstream (`audio_seconds_per_token`) orders its requests by
playback deadline instead of arrival (vllm_omni/playback.py, `token_deadline`): the waiting ones
are admitted earliest deadline first (a new request is due at its arrival + the first-audio
target, a preempted one when the audio of its tokens has played), and the running ones are kept
in deadline order, so the one preempted first is the one with the most audio ahead of its
listener. Every running row still decodes each step: the order matters only at admission and
preemption (docs/streaming.md, "Scheduling by playback deadline").
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.playback import DEFAULT_FIRST_AUDIO_TARGET_S, token_deadline


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # False (vLLM's enable_chunked_prefill=False): a prompt is prefilled in one step or waits.
    # Recomputing a preempted request may still take several steps (same results).
    enable_chunked_prefill: bool = True
    # Seconds of audio each output token becomes downstream (a talker's codec frame); None: order
    # requests by arrival (not an audio stream).
    audio_seconds_per_token: float | None = None
    first_audio_target_s: float = DEFAULT_FIRST_AUDIO_TARGET_S

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.audio_seconds_per_token is not None and not self.audio_seconds_per_token > 0:
            raise ValueError(f"audio_seconds_per_token must be > 0, got {self.audio_seconds_per_token}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computes token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so the step yields the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        # In arrival (or playback deadline) order: the last one is preempted first.
        self.running: list[Request] = []
        self.waiting_for_input: dict[str, Request] = {}  # started, blocked on streamed input
        self.resumable: deque[Request] = deque()  # blocked ones that can go on: before `waiting`
        self.requests: dict[str, Request] = {}
        self._arrived_at: dict[str, float] = {}  # playback order only

    @property
    def by_deadline(self) -> bool:
        return self.config.audio_seconds_per_token is not None

    def deadline(self, request: Request) -> float:
        """When the audio of this request's tokens so far has played (playback order only)."""
        assert self.config.audio_seconds_per_token is not None
        return token_deadline(self._arrived_at[request.request_id], request.num_output_tokens,
                              self.config.audio_seconds_per_token, self.config.first_audio_target_s)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.by_deadline:
            self._arrived_at[request.request_id] = self.clock()
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """A schedule() now would compute something (blocked requests wait for wake())."""
        return bool(self.resumable) or any(r.computable for r in self.running) or \
            any(r.computable for r in self.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def wake(self, request: Request) -> None:
        """Its input grew or it was resumed: back into the batch if it can go on."""
        if request.request_id in self.waiting_for_input and request.computable:
            del self.waiting_for_input[request.request_id]
            self.resumable.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        self._park_blocked()
        while self.resumable and len(self.running) < self.config.max_num_seqs:
            request = self.resumable.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        if self.by_deadline:
            self.running.sort(key=self.deadline)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_computable(min(request.num_tokens - request.num_computed_tokens, budget))
            if num_new == 0:
                i += 1
                continue
            while not self.block_manager.has_room(request, num_new) and not self.block_manager.allocate(request, num_new):
                victim = self._blocked_victim() or self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing older can be made to fit

        # New work only when nothing had to be preempted this step (vLLM does the same):
        # admitting requests while evicting others would thrash.
        for request in sorted(self.waiting, key=self.deadline) if self.by_deadline else list(self.waiting):
            if not (budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs):
                break
            if not request.computable:  # paused, or its first input chunk is not there yet
                continue
            cached = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            limit = request.input_limit if request.input_limit is not None else request.num_tokens
            num_new = min(min(request.num_tokens, limit) - num_cached_tokens, budget)
            if num_new <= 0:
                continue
            whole_prompt_waits = (not self.config.enable_chunked_prefill and request.num_output_tokens == 0
                                  and num_new < request.num_tokens - num_cached_tokens)
            if whole_prompt_waits or not self.block_manager.allocate(request, num_new, cached):
                break
            self.waiting.remove(request)
            request.num_computed_tokens = num_cached_tokens
            if request.num_output_tokens == 0:
                request.num_cached_tokens = num_cached_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _park_blocked(self) -> None:
        """Running requests that cannot compute their next position leave the batch."""
        for request in [r for r in self.running if not r.computable]:
            self.running.remove(request)
            request.status = RequestStatus.WAITING_FOR_INPUT
            self.waiting_for_input[request.request_id] = request

    def _blocked_victim(self) -> Request | None:
        """The newest (latest due) request that holds blocks without running, if any."""
        parked = [*self.waiting_for_input.values(), *self.resumable]
        return max(parked, key=self.deadline if self.by_deadline else lambda r: r.arrival_order) if parked else None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.resumable:
            self.resumable.remove(request)
        else:
            del self.waiting_for_input[request.request_id]
        self.block_manager.free(request)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens were computed (before new tokens are appended)."""
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert status.finished
        request.status = status
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            if request in self.running:
                self.running.remove(request)
            elif request in self.resumable:
                self.resumable.remove(request)
            else:
                self.waiting_for_input.pop(request.request_id, None)
            self.block_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._arrived_at.pop(request.request_id, None)
