"""What the server reads of a request's `OmniRequestOutput`s: the events a stream sends, the totals
a response reports, and the timings the metrics observe.

Nothing accumulates here: the orchestrator's `OutputAccumulator` (vllm_omni/output_accumulator.py)
is the one place that does. A streaming request gets CUMULATIVE outputs (AsyncOmni
`output_partial=True`: the whole output so far in `request_output`, what is new in `delta`), a
non-streaming one the FINAL_ONLY output; the tracker keeps the latest output of each modality and
reads the totals from it. `add()` turns an output's delta into the event a stream sends.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_omni.outputs import CompletionOutput, OmniRequestOutput

logger = logging.getLogger(__name__)

AUDIO_KEY = "audio"  # contract: outputs[0].multimodal_output["audio"], float32 at 24 kHz


def _samples(tensor: torch.Tensor | None) -> np.ndarray:
    return np.zeros(0, np.float32) if tensor is None else tensor.detach().float().cpu().numpy().reshape(-1)


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
class ResponseTracker:
    arrived_at: float = field(default_factory=time.monotonic)
    text_output: OmniRequestOutput | None = None  # the latest of the text stage
    audio_output: OmniRequestOutput | None = None  # the latest of the audio stage
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
        self.text_output = out
        delta = out.delta.text
        if delta and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        new_logprobs = list(zip(out.delta.token_ids, out.delta.logprobs)) if out.delta.logprobs else []
        if not delta and not out.finished and not new_logprobs:
            return None
        return TextEvent(delta, out.finished, self.finish_reason if out.finished else None, new_logprobs)

    def _add_audio(self, out: OmniRequestOutput) -> AudioEvent | None:
        self.audio_output = out
        new = _samples(out.delta.multimodal_output.get(AUDIO_KEY))
        now = time.monotonic()
        if new.size:
            if self.first_audio_at is None:
                self.first_audio_at = now
            else:
                self.audio_gaps.append(now - self.last_audio_at)
            self.last_audio_at = now
        if out.finished:
            self.last_audio_at = now
        if not new.size and not out.finished:
            return None
        return AudioEvent(new, out.finished)

    # --- totals, read from the latest outputs ----------------------------------------------
    def _text(self) -> CompletionOutput | None:
        return self.text_output.request_output.outputs[0] if self.text_output is not None else None

    @property
    def text(self) -> str:
        comp = self._text()
        return comp.text if comp is not None else ""

    @property
    def text_finished(self) -> bool:
        return self.text_output is not None and self.text_output.finished

    @property
    def finish_reason(self) -> str | None:
        comp = self._text()
        return (comp.finish_reason or "stop") if self.text_finished and comp is not None else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.text_output.request_output.prompt_token_ids) if self.text_output is not None else 0

    @property
    def completion_tokens(self) -> int:
        comp = self._text()
        return len(comp.token_ids) if comp is not None else 0

    @property
    def token_logprobs(self) -> list[tuple[int, dict[int, float]]]:
        """Every output token's (id, {id: logprob} of it and its top alternatives)."""
        comp = self._text()
        return list(zip(comp.token_ids, comp.logprobs)) if comp is not None and comp.logprobs else []

    @property
    def audio_finished(self) -> bool:
        return self.audio_output is not None and self.audio_output.finished

    def audio(self) -> np.ndarray:
        if self.audio_output is None:
            return np.zeros(0, np.float32)
        return _samples(self.audio_output.request_output.outputs[0].multimodal_output.get(AUDIO_KEY))

    @property
    def audio_samples(self) -> int:
        if self.audio_output is None:
            return 0
        tensor = self.audio_output.request_output.outputs[0].multimodal_output.get(AUDIO_KEY)
        return 0 if tensor is None else tensor.numel()

    def finished(self, modality: str) -> bool:
        return self.text_finished if modality == "text" else self.audio_finished
