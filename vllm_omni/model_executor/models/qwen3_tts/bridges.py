"""Qwen3-TTS bridge (spec 003 stage input processor): talker -> code2wav.

The talker exports its generated frames (`codec_codes` [frames, groups]) and, for in-context
voice cloning, the reference's frames (`ref_codes`). code2wav gets them joined (reference
first: qwen-tts decodes them together so the voice continues) and flattened codebook-major,
with the number of reference frames to cut from the audio. Over a streaming edge (async_chunk)
the same frames go as the talker makes them (TALKER_TO_CODE2WAV_STREAM), the reference's first.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.bridge_utils import codes_without_stop_token, source_outputs
from vllm_omni.model_executor.models.qwen3_tts.code2wav import CONTEXT_FRAMES_KEY
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY
from vllm_omni.outputs import RequestOutput
from vllm_omni.stage_io import STREAM_UNITS_KEY, StageOutput, StreamBridge


def talker2code2wav(
    stage_list: list[Any],
    engine_input_source: list[int],
    prompt: Any = None,
    requires_multimodal_data: bool = False,
) -> list[OmniTokensPrompt]:
    return [_code2wav_prompt(out) for out in source_outputs(stage_list, engine_input_source)]


def _code2wav_prompt(out: RequestOutput) -> OmniTokensPrompt:
    outputs = out.outputs[0].multimodal_output
    codes = outputs.get(CODES_KEY)
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(f"request {out.request_id}: talker output lacks {CODES_KEY!r} [frames, groups] "
                         f"(have {sorted(outputs)})")
    sampled = codes_without_stop_token(out)
    codes = codes[: len(sampled)]
    if codes[:, 0].tolist() != sampled:
        raise ValueError(f"request {out.request_id}: {CODES_KEY} ({codes.shape[0]} frames) do not match the "
                         f"talker's {len(sampled)} sampled tokens")
    if codes.shape[0] == 0:
        raise ValueError(f"request {out.request_id}: the talker produced no codec frames (it stopped at once)")
    ref = outputs.get(REF_CODES_KEY)
    context = 0
    if isinstance(ref, torch.Tensor) and ref.numel():
        context = ref.shape[0]
        codes = torch.cat([ref.to(codes.dtype), codes])
    return OmniTokensPrompt(prompt_token_ids=codes.to(torch.long).T.reshape(-1).tolist(),
                            additional_information={CONTEXT_FRAMES_KEY: context} if context else {})


# --- streaming edge (async_chunk): the same frames, sent as the talker makes them -------------

def _start_code2wav(talker: RequestOutput, prompt: Any) -> OmniTokensPrompt | None:
    outputs = talker.outputs[0].multimodal_output
    frames = outputs.get(CODES_KEY)
    if frames is None or frames.shape[0] == 0:
        if talker.finished:
            raise ValueError(f"request {talker.request_id}: the talker produced no codec frames (it stopped at once)")
        return None
    ref = outputs.get(REF_CODES_KEY)
    if not isinstance(ref, torch.Tensor) or not ref.numel():
        return OmniTokensPrompt(prompt_token_ids=[], additional_information={STREAM_UNITS_KEY: frames})
    return OmniTokensPrompt(prompt_token_ids=[], additional_information={
        STREAM_UNITS_KEY: torch.cat([ref.to(frames.dtype), frames]), CONTEXT_FRAMES_KEY: ref.shape[0]})


def _code2wav_chunk(delta: StageOutput) -> dict[str, torch.Tensor]:
    """The codec frames [n, groups] of one talker delta (the talker never hands out an EOS frame)."""
    frames = delta.multimodal_output.get(CODES_KEY)
    return {STREAM_UNITS_KEY: frames} if frames is not None and frames.shape[0] else {}


# talker2code2wav's layout: every code group of every frame, codebook-major, reference first.
TALKER_TO_CODE2WAV_STREAM = StreamBridge(start=_start_code2wav, chunk=_code2wav_chunk,
                                         prompt_token_ids=lambda frames: frames.T.reshape(-1).tolist())
