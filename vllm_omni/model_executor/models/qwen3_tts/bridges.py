"""Qwen3-TTS bridge (spec 003 stage input processor): talker -> code2wav.

The talker exports its generated frames (`codec_codes` [frames, groups]) and, for in-context
voice cloning, the reference's frames (`ref_codes`). code2wav gets them joined (reference
first: qwen-tts decodes them together so the voice continues) and flattened codebook-major,
with the number of reference frames to cut from the audio.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.model_executor.models.bridge_utils import codes_without_stop_token, source_outputs
from vllm_omni.model_executor.models.qwen3_tts.code2wav import CONTEXT_FRAMES_KEY
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY
from vllm_omni.outputs import RequestOutput


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
