"""Results returned to users (vLLM's shapes)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

# token id -> logprob, for the sampled token and the top-N alternatives.
TokenLogprobs = dict[int, float]


class RequestOutputKind(enum.IntEnum):
    """What a reader of a request receives (vLLM's RequestOutputKind; the values are vLLM's).

    CUMULATIVE: an output each time something new exists, each holding everything so far;
    DELTA: an output each time something new exists, each holding only what is new;
    FINAL_ONLY: one output, when the request finishes, holding everything.
    `output_accumulator.OutputAccumulator` makes them from a stage's deltas."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    # Tensors a stage exports for the next one (spec 003 reads `outputs[0].multimodal_output[key]`).
    # For AR stages: hidden states keyed "0", "12", ..., "last" (transformers' output_hidden_states
    # indices), one row per prompt and output token computed (the last sampled token has none yet).
    multimodal_output: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


@dataclass
class OmniRequestOutput:
    """One final output of a multi-stage request: what a `final_output: true` stage produced.

    `request_output.outputs[0]` holds the tokens/text (text stages) or, in
    `multimodal_output`, the tensors (e.g. audio) of that stage: everything the stage produced
    for the request so far (CUMULATIVE and FINAL_ONLY outputs), or only what is new (DELTA,
    where it is `delta` itself). A failed request's output has `request_output.error` set and
    finish_reason "error".

    `delta` holds what this output adds to the previous output of the same stage delivered
    for the same request: new token ids, new text, new tensor rows (tensor outputs grow by
    chunks along dim 0, e.g. audio samples). Streaming (AsyncOmni `output_partial=True`)
    yields `finished=False` outputs whose deltas are the step's new tokens / the new audio
    chunk, then the `finished=True` one with the rest; without streaming the one output's
    delta is the whole result. So `"".join(o.delta.text for o in outputs_of_a_stage)` is
    always the final text.
    """

    request_id: str
    stage_id: int
    final_output_type: str  # "text" | "audio" | "image" | "video"
    request_output: RequestOutput
    finished: bool = True
    delta: CompletionOutput | None = None
    # Seconds per phase of the request in the stages that profile it (upstream's field: e.g.
    # "ar_stage_0", "ar_stage_0.prefill", "QwenImagePipeline.diffuse"); empty when none does.
    stage_durations: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        return self.request_output.error
