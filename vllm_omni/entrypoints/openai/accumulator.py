"""Fold a request's stream of `OmniRequestOutput`s into what the API sends.

AsyncOmni yields, per final-output stage, partial outputs (finished=False) and one finished
output; each carries `delta`, what is new since the previous output of that stage (the
orchestrator's request state computes it once). `add()` turns the delta into events:
streaming sends each at once, non-streaming keeps only the totals.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

AUDIO_KEY = "audio"  # contract: outputs[0].multimodal_output["audio"], float32 at 24 kHz


@dataclass
class TextEvent:
    delta: str
    finished: bool
    finish_reason: str | None
    # (token id, {token id: logprob} of it and its top alternatives) of the tokens new since the
    # last event; empty unless the request asked for logprobs
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)


@dataclass
class AudioEvent:
    samples: np.ndarray  # [n] float32, the new samples only
    finished: bool


@dataclass
class RequestAccumulator:
    arrived_at: float = field(default_factory=time.monotonic)
    text: str = ""
    finish_reason: str | None = None
    text_finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # every output token's
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    audio_samples: int = 0
    audio_finished: bool = False
    first_text_at: float | None = None
    first_audio_at: float | None = None
    last_audio_at: float | None = None
    audio_gaps: list[float] = field(default_factory=list)  # between consecutive audio chunks
    stage_durations: dict[str, float] = field(default_factory=dict)  # the profilers' (metrics.stage_durations)

    def add(self, out: OmniRequestOutput) -> list[TextEvent | AudioEvent]:
        self.stage_durations.update(out.stage_durations)
        if out.final_output_type == "text":
            event = self._add_text(out)
        elif out.final_output_type == "audio":
            event = self._add_audio(out)
        else:  # the chat/completions APIs have no place for images or video
            logger.warning("request %s: ignoring a %s output", out.request_id, out.final_output_type)
            return []
        return [event] if event is not None else []

    def _add_text(self, out: OmniRequestOutput) -> TextEvent | None:
        delta = out.delta.text
        self.prompt_tokens = len(out.request_output.prompt_token_ids)
        self.completion_tokens += len(out.delta.token_ids)
        self.text += delta
        if delta and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        if out.finished:
            self.text_finished = True
            self.finish_reason = out.delta.finish_reason or "stop"
        new_logprobs = list(zip(out.delta.token_ids, out.delta.logprobs)) if out.delta.logprobs else []
        self.token_logprobs += new_logprobs
        if not delta and not out.finished and not new_logprobs:
            return None
        return TextEvent(delta, out.finished, self.finish_reason if out.finished else None, new_logprobs)

    def _add_audio(self, out: OmniRequestOutput) -> AudioEvent | None:
        tensor = out.delta.multimodal_output.get(AUDIO_KEY)
        new = np.zeros(0, np.float32) if tensor is None else tensor.detach().float().cpu().numpy().reshape(-1)
        now = time.monotonic()
        if new.size:
            self.audio_chunks.append(new)
            self.audio_samples += new.size
            if self.first_audio_at is None:
                self.first_audio_at = now
            else:
                self.audio_gaps.append(now - self.last_audio_at)
            self.last_audio_at = now
        if out.finished:
            self.audio_finished = True
            self.last_audio_at = now
        if not new.size and not out.finished:
            return None
        return AudioEvent(new, out.finished)

    def finished(self, modality: str) -> bool:
        return self.text_finished if modality == "text" else self.audio_finished

    def audio(self) -> np.ndarray:
        return np.concatenate(self.audio_chunks) if self.audio_chunks else np.zeros(0, np.float32)
