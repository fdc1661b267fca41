"""Qwen2.5-Omni bridges (spec 003 stage input processors): thinker -> talker -> code2wav.

Each bridge turns one upstream `RequestOutput` into one `OmniTokensPrompt`, built only from
that output (the orchestrator calls bridges per request; a batch given here is still handled
output by output, so requests cannot mix). Payloads are typed dataclasses flattened into
`additional_information` (tensors and msgpack data only, so they travel as frames); the stage
model parses them back with `from_info`, which validates shapes.

The talker's input follows transformers' `Qwen2_5OmniForConditionalGeneration.generate`: it
needs the thinker's input embeddings (hidden-state key "0") and final hidden states ("last")
of the prompt and of every reply token that has them (all but the last sampled token). The
arithmetic on them (zeroing multimodal placeholders, sums, special-token embeddings) belongs
to the talker model, which knows its config; the bridge only selects and checks.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.bridge_utils import (
    SPEAKER_KEY,
    check_speaker,
    codes_without_stop_token,
    multimodal_layout,
    requested_speaker,
    source_outputs,
)
from vllm_omni.model_executor.models.talker_inputs import THINKER_EMBEDS_KEY, THINKER_HIDDEN_KEY, TalkerInputs
from vllm_omni.outputs import RequestOutput
from vllm_omni.stage_io import STREAM_UNITS_KEY, StageOutput, StreamBridge

NUM_STEPS_KEY = "num_steps"  # code2wav: DiT ODE steps of one request


@dataclass(frozen=True)
class Code2WavInputs:
    """talker2code2wav payload; the codec codes themselves are the prompt_token_ids."""

    speaker: str | None = None  # None: the default voice
    num_steps: int | None = None  # DiT ODE steps; None: the stage's default

    def __post_init__(self) -> None:
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 2):
            raise ValueError(f"code2wav inputs: num_steps must be an integer >= 2, got {self.num_steps!r}")

    def to_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self.speaker is not None:
            info[SPEAKER_KEY] = self.speaker
        if self.num_steps is not None:
            info[NUM_STEPS_KEY] = self.num_steps
        return info

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> Code2WavInputs:
        unknown = sorted(set(info) - {SPEAKER_KEY, NUM_STEPS_KEY})
        if unknown:
            raise ValueError(f"code2wav inputs: unknown key(s) {unknown}; expected {[SPEAKER_KEY, NUM_STEPS_KEY]}")
        return cls(speaker=check_speaker(info.get(SPEAKER_KEY)), num_steps=info.get(NUM_STEPS_KEY))


def thinker2talker(
    stage_list: list[Any],
    engine_input_source: list[int],
    prompt: Any = None,
    requires_multimodal_data: bool = False,
) -> list[OmniTokensPrompt]:
    speaker, layout = requested_speaker(prompt), multimodal_layout(prompt)
    return [_talker_prompt(out, speaker, layout) for out in source_outputs(stage_list, engine_input_source)]


def talker2code2wav(
    stage_list: list[Any],
    engine_input_source: list[int],
    prompt: Any = None,
    requires_multimodal_data: bool = False,
) -> list[OmniTokensPrompt]:
    info = Code2WavInputs(speaker=requested_speaker(prompt)).to_info()
    inputs = []
    for out in source_outputs(stage_list, engine_input_source):
        codes = codes_without_stop_token(out)
        if not codes:
            raise ValueError(f"request {out.request_id}: the talker produced no codec codes")
        inputs.append(OmniTokensPrompt(prompt_token_ids=codes, additional_information=dict(info)))
    return inputs


def _talker_prompt(out: RequestOutput, speaker: str | None, layout: dict[str, Any]) -> OmniTokensPrompt:
    comp = out.outputs[0]
    num_prompt, num_reply = len(out.prompt_token_ids), len(comp.token_ids)
    if num_reply == 0:
        raise ValueError(f"request {out.request_id}: the thinker produced no tokens to speak")
    states = comp.multimodal_output
    missing = [k for k in (THINKER_EMBEDS_KEY, THINKER_HIDDEN_KEY) if k not in states]
    if missing:
        raise ValueError(f"request {out.request_id}: thinker output lacks hidden states {missing} (have "
                         f"{sorted(states)}); run the thinker with engine_output_type latent and layer 0 exported")
    # Every prompt and reply token except the last sampled one went through the thinker.
    rows = num_prompt + num_reply - 1
    for key in (THINKER_EMBEDS_KEY, THINKER_HIDDEN_KEY):
        if states[key].shape[0] != rows:
            raise ValueError(f"request {out.request_id}: thinker hidden states {key!r} have {states[key].shape[0]} "
                             f"rows, expected {rows} ({num_prompt} prompt + {num_reply} reply tokens - 1)")
    payload = TalkerInputs(
        thinker_prompt_token_ids=list(out.prompt_token_ids),
        thinker_embeds=states[THINKER_EMBEDS_KEY].detach(),
        thinker_hidden=states[THINKER_HIDDEN_KEY].detach(),
        speaker=speaker,
        **layout,
    )
    # Placeholder ids of the talker's prompt length (P thinker rows + speaker bos + first reply
    # row); the talker supplies its codec ids (`prompt_token_ids` hook), which the bridge
    # cannot know without the talker's config.
    return OmniTokensPrompt(prompt_token_ids=[0] * (num_prompt + 2), additional_information=payload.to_info())


# --- streaming edges (async_chunk): the same inputs, built as the upstream stage generates ------

def _start_talker(thinker: RequestOutput, prompt: Any) -> OmniTokensPrompt | None:
    # The talker's prompt ends with r_0, the thinker's row of its first reply token, which
    # exists once that token went back through the thinker (it sampled a second one).
    if not thinker.finished and len(thinker.outputs[0].token_ids) < 2:
        return None
    return _talker_prompt(thinker, requested_speaker(prompt), multimodal_layout(prompt))


def _talker_chunk(delta: StageOutput) -> dict[str, torch.Tensor]:
    """The thinker rows of one delta ({} when it computed none)."""
    states = delta.multimodal_output
    if THINKER_EMBEDS_KEY not in states:
        return {}
    return {"thinker_embeds": states[THINKER_EMBEDS_KEY], "thinker_hidden": states[THINKER_HIDDEN_KEY]}


def _start_code2wav(talker: RequestOutput, prompt: Any) -> OmniTokensPrompt:
    codes = codes_without_stop_token(talker) if talker.finished else list(talker.outputs[0].token_ids)
    if talker.finished and not codes:
        raise ValueError(f"request {talker.request_id}: the talker produced no codec codes")
    info = Code2WavInputs(speaker=requested_speaker(prompt)).to_info()
    info[STREAM_UNITS_KEY] = torch.tensor(codes, dtype=torch.long)
    return OmniTokensPrompt(prompt_token_ids=[], additional_information=info)


def _code2wav_chunk(delta: StageOutput) -> dict[str, torch.Tensor]:
    codes = list(delta.new_token_ids)
    # The token that stopped the talker (codec end / pad) is not spoken.
    if delta.finished and delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str) and codes:
        codes.pop()
    return {STREAM_UNITS_KEY: torch.tensor(codes, dtype=torch.long)} if codes else {}


THINKER_TO_TALKER_STREAM = StreamBridge(start=_start_talker, chunk=_talker_chunk)
TALKER_TO_CODE2WAV_STREAM = StreamBridge(start=_start_code2wav, chunk=_code2wav_chunk,
                                         prompt_token_ids=lambda codes: codes.tolist())
