"""Qwen3-TTS bridge (spec 003 stage input processor): talker -> code2wav.

The talker exports its generated frames (`codec_codes` [frames, groups]) and, for in-context
voice cloning, the reference's frames (`ref_codes`). code2wav gets them joined (reference
first: qwen-tts decodes them together so the voice continues) and flattened codebook-major,
with the number of reference frames to cut from the audio. Over a streaming edge (async_chunk)
the same frames go as the talker makes them (TALKER_TO_CODE2WAV_STREAM), the reference's first.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.bridge_utils import finished_frames, frames_chunk, frames_so_far, source_outputs
from vllm_omni.model_executor.models.qwen3_tts.code2wav import CONTEXT_FRAMES_KEY
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY
from vllm_omni.outputs import RequestOutput
from vllm_omni.stage_io import STREAM_UNITS_KEY, StreamBridge


def talker2code2wav(
    stage_list: list[Any],
    engine_input_source: list[int],
    prompt: Any = None,
    requires_multimodal_data: bool = False,
) -> list[OmniTokensPrompt]:
    return [_code2wav_prompt(out) for out in source_outputs(stage_list, engine_input_source)]


def _code2wav_prompt(out: RequestOutput) -> OmniTokensPrompt:
    frames, context = _with_reference(out, finished_frames(out, CODES_KEY))
    return OmniTokensPrompt(prompt_token_ids=frames.to(torch.long).T.reshape(-1).tolist(),
                            additional_information={CONTEXT_FRAMES_KEY: context} if context else {})


def _with_reference(out: RequestOutput, frames: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The reference's frames (in-context voice cloning) before the talker's, and how many."""
    ref = out.outputs[0].multimodal_output.get(REF_CODES_KEY)
    if not isinstance(ref, torch.Tensor) or not ref.numel():
        return frames, 0
    return torch.cat([ref.to(frames.dtype), frames]), ref.shape[0]


# --- streaming edge (async_chunk): the same frames, sent as the talker makes them -------------

def _start_code2wav(talker: RequestOutput, prompt: Any) -> OmniTokensPrompt | None:
    frames = frames_so_far(talker, CODES_KEY)
    if frames is None:
        return None
    frames, context = _with_reference(talker, frames)
    info = {STREAM_UNITS_KEY: frames, CONTEXT_FRAMES_KEY: context} if context else {STREAM_UNITS_KEY: frames}
    return OmniTokensPrompt(prompt_token_ids=[], additional_information=info)


# talker2code2wav's layout: every code group of every frame, codebook-major, reference first.
TALKER_TO_CODE2WAV_STREAM = StreamBridge(start=_start_code2wav, chunk=functools.partial(frames_chunk, key=CODES_KEY),
                                         prompt_token_ids=lambda frames: frames.T.reshape(-1).tolist())
