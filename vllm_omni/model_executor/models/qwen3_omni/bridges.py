"""Qwen3-Omni bridges (spec 003 stage input processors): thinker -> talker -> code2wav.

Same contract as the Qwen2.5-Omni bridges (one upstream `RequestOutput` -> one
`OmniTokensPrompt`, typed payloads flattened into `additional_information`, requests never
mixed); what differs is what the talker reads:

- The thinker's input embeddings (hidden-state key "0") and its hidden states at the talker's
  `accept_hidden_layer` (key "24" for the released model). transformers feeds the talker
  `hidden_states[accept_hidden_layer]`, which is our export key of the same number. The bridge
  cannot read the talker config, so it takes the one numeric layer besides "0" that the
  thinker exported and names it in the payload; the talker checks it is its own layer.
- Its prompt layout (user turns + 9 assistant rows, transformers' `_get_talker_user_parts` /
  `_get_talker_assistant_parts`) depends on token ids of the top-level config, so the talker
  builds its own prompt ids (`prompt_token_ids` hook); the bridge sends placeholders.

talker2code2wav hands code2wav the talker's `code_predictor_codes` [frames, num_code_groups]
flattened codebook-major (all frames of group 0, then group 1, ...), as spec 003 does.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.bridge_utils import (
    finished_frames,
    frames_chunk,
    frames_so_far,
    multimodal_layout,
    requested_speaker,
    source_outputs,
)
from vllm_omni.model_executor.models.talker_inputs import THINKER_EMBEDS_KEY, THINKER_HIDDEN_KEY
from vllm_omni.model_executor.models.talker_inputs import TalkerInputs as _TalkerInputs
from vllm_omni.outputs import RequestOutput
from vllm_omni.stage_io import STREAM_UNITS_KEY, StageOutput, StreamBridge

CODES_KEY = "code_predictor_codes"  # the talker's export: [frames, num_code_groups] long
HIDDEN_LAYER_KEY = "thinker_hidden_layer"
_NOT_LAYERS = (THINKER_EMBEDS_KEY, THINKER_HIDDEN_KEY)


@dataclass(frozen=True)
class TalkerInputs(_TalkerInputs):
    """thinker2talker payload of one request: the shared fields (P prompt tokens, embeddings and
    hidden states of the P + R tokens the thinker ran, speaker, multimodal layout) plus which
    thinker layer `thinker_hidden` holds."""

    thinker_hidden_layer: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.thinker_hidden_layer is not None and not isinstance(self.thinker_hidden_layer, int):
            raise ValueError(f"talker inputs: {HIDDEN_LAYER_KEY} must be an integer, got {self.thinker_hidden_layer!r}")

    @property
    def num_reply_rows(self) -> int:
        """R: reply tokens that went through the thinker (all but the last sampled one)."""
        return self.thinker_embeds.shape[0] - self.num_prompt_tokens

    def to_info(self) -> dict[str, Any]:
        info = super().to_info()
        if self.thinker_hidden_layer is not None:
            info[HIDDEN_LAYER_KEY] = self.thinker_hidden_layer
        return info

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TalkerInputs:
        info = dict(info)
        layer = info.pop(HIDDEN_LAYER_KEY, None)
        return dataclasses.replace(super().from_info(info), thinker_hidden_layer=layer)


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
    return [_code2wav_prompt(out) for out in source_outputs(stage_list, engine_input_source)]


def _talker_prompt(out: RequestOutput, speaker: str | None, layout: dict[str, Any]) -> OmniTokensPrompt:
    comp = out.outputs[0]
    num_prompt, num_reply = len(out.prompt_token_ids), len(comp.token_ids)
    # transformers' talker prompt ends with the first reply token; its stream is the rest.
    if num_reply < 2:
        raise ValueError(f"request {out.request_id}: the thinker produced {num_reply} token(s); the talker needs "
                         "at least 2 (the first reply token and the end of the reply)")
    states = comp.multimodal_output
    layer = _hidden_layer(out.request_id, states)
    rows = num_prompt + num_reply - 1  # every token but the last sampled one went through the thinker
    for key in (THINKER_EMBEDS_KEY, str(layer)):
        if states[key].shape[0] != rows:
            raise ValueError(f"request {out.request_id}: thinker hidden states {key!r} have {states[key].shape[0]} "
                             f"rows, expected {rows} ({num_prompt} prompt + {num_reply} reply tokens - 1)")
    payload = TalkerInputs(
        thinker_prompt_token_ids=list(out.prompt_token_ids),
        thinker_embeds=states[THINKER_EMBEDS_KEY].detach(),
        thinker_hidden=states[str(layer)].detach(),
        thinker_hidden_layer=layer,
        speaker=speaker,
        **layout,
    )
    # Placeholders: the talker lays out its own prompt from the payload (its prompt_token_ids hook).
    return OmniTokensPrompt(prompt_token_ids=[0] * num_prompt, additional_information=payload.to_info())


def _hidden_layer(request_id: str, states: Mapping[str, torch.Tensor]) -> int:
    if THINKER_EMBEDS_KEY not in states:
        raise ValueError(f"request {request_id}: thinker output lacks its input embeddings (hidden-state key "
                         f"{THINKER_EMBEDS_KEY!r}); run the thinker with engine_output_type latent")
    layers = sorted(int(k) for k in states if k not in _NOT_LAYERS and k.isdigit())
    if len(layers) != 1:
        raise ValueError(f"request {request_id}: expected exactly one thinker layer besides {THINKER_EMBEDS_KEY!r} "
                         f"(the talker's accept_hidden_layer), got {sorted(states)}")
    return layers[0]


def _code2wav_prompt(out: RequestOutput) -> OmniTokensPrompt:
    frames = finished_frames(out, CODES_KEY)
    return OmniTokensPrompt(prompt_token_ids=frames.to(torch.long).T.reshape(-1).tolist(), additional_information={})


# --- streaming edges (async_chunk): the same inputs, built as the upstream stage generates ------

def _start_talker(thinker: RequestOutput, prompt: Any) -> OmniTokensPrompt | None:
    # The talker's prompt ends with the thinker's row of its first reply token, which exists
    # once that token went back through the thinker (it sampled a second one).
    if not thinker.finished and len(thinker.outputs[0].token_ids) < 2:
        return None
    return _talker_prompt(thinker, requested_speaker(prompt), multimodal_layout(prompt))


def _talker_chunk(delta: StageOutput) -> dict[str, torch.Tensor]:
    """The thinker rows of one delta ({} when it computed none)."""
    states = delta.multimodal_output
    if THINKER_EMBEDS_KEY not in states:
        return {}
    layer = _hidden_layer(delta.request_id, states)
    return {"thinker_embeds": states[THINKER_EMBEDS_KEY], "thinker_hidden": states[str(layer)]}


def _start_code2wav(talker: RequestOutput, prompt: Any) -> OmniTokensPrompt | None:
    frames = frames_so_far(talker, CODES_KEY)
    return None if frames is None else OmniTokensPrompt(prompt_token_ids=[],
                                                        additional_information={STREAM_UNITS_KEY: frames})


THINKER_TO_TALKER_STREAM = StreamBridge(start=_start_talker, chunk=_talker_chunk)
# talker2code2wav's layout: every code group of every frame, codebook-major.
TALKER_TO_CODE2WAV_STREAM = StreamBridge(start=_start_code2wav, chunk=functools.partial(frames_chunk, key=CODES_KEY),
                                         prompt_token_ids=lambda frames: frames.T.reshape(-1).tolist())
