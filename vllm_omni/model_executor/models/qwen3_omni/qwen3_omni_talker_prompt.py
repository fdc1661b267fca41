"""Which thinker rows the Qwen3-Omni talker's prompt is made of, and its M-RoPE positions.

Pure bookkeeping on token ids (no weights), following `Qwen3OmniMoeForConditionalGeneration.
generate`: the talker prompt is the thinker prompt's user turns (every token whose latest
`<|im_start|>` is followed by `user`, in order) and 9 assistant rows; its ids for M-RoPE are
[those user tokens, tts_pad x 9]. Positions are plain text positions unless the request has
image/video grids; then they are transformers' `get_rope_index` over those ids (our port,
rope_index.py; audio alone counts like text there, as in transformers, and so does
use_audio_in_video, which transformers never passes to its talker): long when integral,
float32 when a video's frame times are fractional (29.97 fps, 1 s clips), as transformers has them.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from transformers import PretrainedConfig

from vllm_omni.model_executor.models.qwen3_omni.rope_index import (
    RopeTokenConfig,
    as_index_positions,
    qwen3_omni_rope_index,
)
from vllm_omni.model_executor.models.qwen3_omni.bridges import TalkerInputs

NUM_ASSISTANT_ROWS = 9  # <|im_start|> assistant \n, tts_pad x4, tts_bos, first reply token
_MIN_ASSISTANT_ROWS = 4  # transformers reads rows 0-2 (turn header) and 3 (first reply token)


@dataclass(frozen=True)
class TalkerPrompt:
    user_index: torch.Tensor  # [U] long: thinker prompt positions of the user turns
    multimodal: torch.Tensor  # [P] bool: audio/image/video placeholders of the thinker prompt
    assistant_start: int  # thinker position of the last `<|im_start|>assistant`
    speaker_id: int  # codec id of the voice
    positions: torch.Tensor  # [3, U + 9] long (float32 if fractional), CPU; output continues from the last column

    @property
    def num_tokens(self) -> int:
        return self.user_index.numel() + NUM_ASSISTANT_ROWS


def talker_prompt(config: PretrainedConfig, inputs: TalkerInputs, speaker: str) -> TalkerPrompt:
    """`config` is the full Qwen3OmniMoeConfig. ValueError for a request the talker cannot speak."""
    tc, thinker = config.talker_config, config.thinker_config
    voices = tc.speaker_id or {}
    speaker_id = voices.get(speaker.lower())
    if speaker_id is None:
        raise ValueError(f"unknown speaker {speaker!r}; available: {sorted(voices)}")
    ids = torch.tensor(inputs.thinker_prompt_token_ids, dtype=torch.long)
    num = ids.numel()
    pos = torch.arange(num)
    latest_im_start = torch.cummax(torch.where(ids == config.im_start_token_id, pos, -1), dim=0).values.clamp_min(0)
    role = ids[(latest_im_start + 1).clamp_max(num - 1)]
    user_index = torch.nonzero(role == config.user_token_id).flatten()
    starts = torch.nonzero((ids[:-1] == config.im_start_token_id) & (ids[1:] == config.assistant_token_id)).flatten()
    if starts.numel() == 0:
        raise ValueError("the thinker prompt has no '<|im_start|>assistant' turn for the talker to speak")
    assistant_start = int(starts[-1])
    if inputs.thinker_embeds.shape[0] - assistant_start < _MIN_ASSISTANT_ROWS:
        raise ValueError("the talker needs the assistant turn header (3 tokens) and a reply after the last "
                         "'<|im_start|>assistant' of the thinker prompt")
    placeholders = torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id])
    talker_ids = torch.cat([ids[user_index], torch.full((NUM_ASSISTANT_ROWS,), config.tts_pad_token_id)])
    positions = _rope_index(config, talker_ids, inputs)
    return TalkerPrompt(user_index, torch.isin(ids, placeholders), assistant_start, int(speaker_id), positions)


def _rope_index(config: PretrainedConfig, talker_ids: torch.Tensor, inputs: TalkerInputs) -> torch.Tensor:
    grids = [g if g is not None and g.numel() > 0 else None for g in (inputs.image_grid_thw, inputs.video_grid_thw)]
    # The talker config states its own merge size and token ids but has no audio config
    # (transformers reads `talker.config.audio_config`, which is never set): the thinker's.
    rope_tokens = RopeTokenConfig.from_config(config.talker_config,
                                              audio_n_window=config.thinker_config.audio_config.n_window)
    try:
        positions, _ = qwen3_omni_rope_index(
            talker_ids.tolist(), rope_tokens, image_grid_thw=grids[0], video_grid_thw=grids[1],
            audio_seqlens=inputs.audio_feature_lengths, second_per_grids=inputs.video_second_per_grid,
            # transformers' generate hands the talker the grids, audio lengths and seconds per grid
            # but never use_audio_in_video, so its talker lays a video merged with its audio track
            # out as an audio block followed by text; the same here, to the last code.
            use_audio_in_video=False,
        )
    except (IndexError, ValueError) as e:
        raise ValueError(f"talker M-RoPE positions: the user turns do not match the media layout ({e})") from e
    return as_index_positions(positions)
