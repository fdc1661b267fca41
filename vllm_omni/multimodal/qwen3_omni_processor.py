"""Chat messages or a text prompt + media -> the Qwen3-Omni thinker's inputs.

    proc = Qwen3OmniInputProcessor.from_pretrained(model_dir)
    prompt = proc.process_messages(
        [{"role": "user", "content": [{"type": "audio", "audio": (wave, 16000)},
                                      {"type": "text", "text": "What is this?"}]}])
    prompt.prompt_token_ids   # chat template applied, placeholders expanded
    prompt.mm_inputs          # input_features, feature_attention_mask, pixel_values, ...

Same interface, content parts and media loading as Qwen2_5OmniInputProcessor (it is a subclass),
and the same ids and tensors as transformers' Qwen3OmniMoeProcessor (tests/multimodal compare
them). What differs from Qwen2.5-Omni:
  - tokens: <|audio_pad|>, <|image_pad|>, <|video_pad|>, <|audio_start|>/<|audio_end|>;
  - audio: features padded to the longest audio of the request, not to 300 s, and not truncated;
    tokens per audio from the chunked encoder (13 per 100 mel frames at n_window 50);
  - vision: patch 16 (so 32-pixel resize steps), mean = std = 0.5, from preprocessor_config.json;
  - use_audio_in_video: video and audio tokens merged by time, one frame group at a time,
    at 13 position ids per second (not 2 s chunks at 25).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_omni.multimodal.media import MediaError
from vllm_omni.multimodal.qwen2_5_omni_placeholders import OmniTokenIds
from vllm_omni.multimodal.qwen2_5_omni_processor import (  # noqa: F401  (ThinkerPrompt re-exported)
    Qwen2_5OmniInputProcessor,
    ThinkerPrompt,
)
from vllm_omni.multimodal.qwen3_omni_chat_template import QWEN3_OMNI_CHAT_TEMPLATE
from vllm_omni.multimodal.vision import VideoSampling

# The released token names, for tokenizers saved without `audio_token` & co.
_DEFAULT_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
_FACTOR = 32  # patch 16 x merge 2: resized sides are multiples of it
# transformers' Qwen3OmniMoeProcessor resizes video frames to 128..768 merged patches each
# (its videos_kwargs size). The whole-video budget is qwen-omni-utils' 128000 tokens x 0.9.
QWEN3_VIDEO_SAMPLING = VideoSampling(
    min_pixels=128 * _FACTOR**2,
    max_pixels=768 * _FACTOR**2,
    total_pixels=int(128000 * _FACTOR**2 * 0.9),
    image_factor=_FACTOR,
)


def audio_tokens_for_frames(num_frames: int, n_window: int = 50) -> int:
    """Audio encoder outputs for `num_frames` mel frames.

    The encoder cuts the frames into chunks of 2 * n_window and runs three stride-2 convolutions
    on each: a full chunk of 100 frames gives 13 tokens, the remainder chunk its own count.
    transformers' processor hard-codes the 13, so it matches the encoder only at n_window 50;
    this computes the full-chunk count from n_window (the same at 50).
    """

    def after_convs(n: int) -> int:
        for _ in range(3):
            n = (n - 1) // 2 + 1 if n > 0 else 0
        return n

    chunk = 2 * n_window
    return (num_frames // chunk) * after_convs(chunk) + after_convs(num_frames % chunk)


def interleave_video_audio(
    ids: OmniTokenIds,
    grid_thw: list[int],
    merge_size: int,
    second_per_grid: float,
    num_audio_tokens: int,
    position_id_per_seconds: float = 13,
) -> list[int]:
    """use_audio_in_video: the <|video_pad|> placeholder becomes <|audio_start|>, the video and
    audio tokens merged by time, <|audio_end|>. A frame group's tokens sit at its start time
    (t * second_per_grid * position_id_per_seconds) and go before the audio tokens at or after
    it; audio token i sits at i. Leftovers of either follow in order."""
    t, h, w = grid_thw
    per_frame = (h // merge_size) * (w // merge_size)
    out = [ids.audio_bos]
    audio_i = 0
    for frame in range(t):
        start = frame * second_per_grid * position_id_per_seconds
        while audio_i < num_audio_tokens and audio_i < start:
            out.append(ids.audio)
            audio_i += 1
        out += [ids.video] * per_frame
    out += [ids.audio] * (num_audio_tokens - audio_i)
    out.append(ids.audio_eos)
    return out


class Qwen3OmniInputProcessor(Qwen2_5OmniInputProcessor):
    def __init__(
        self,
        tokenizer,
        feature_extractor,
        image_processor,
        chat_template: str | None = None,
        video_sampling: VideoSampling | None = None,
        position_id_per_seconds: float = 13,
        seconds_per_chunk: float = 2.0,  # unused by Qwen3-Omni's interleaving; kept for the config
        n_window: int = 50,
        **kwargs: Any,
    ):
        _name_tokens(tokenizer)  # before the base class reads the names
        super().__init__(
            tokenizer, feature_extractor, image_processor,
            chat_template=chat_template or tokenizer.chat_template or QWEN3_OMNI_CHAT_TEMPLATE,
            video_sampling=video_sampling or QWEN3_VIDEO_SAMPLING.updated({
                "frame_factor": image_processor.temporal_patch_size,
                "image_factor": image_processor.patch_size * image_processor.merge_size,
            }),
            position_id_per_seconds=position_id_per_seconds, seconds_per_chunk=seconds_per_chunk,
            **kwargs,
        )
        self.n_window = n_window

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, tokenizer=None, **kwargs) -> "Qwen3OmniInputProcessor":
        """As Qwen2_5OmniInputProcessor.from_pretrained, plus the audio encoder's n_window."""
        path = Path(model_dir) / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            audio = config.get("thinker_config", config).get("audio_config", {})
            if "n_window" in audio:
                kwargs.setdefault("n_window", audio["n_window"])
        return super().from_pretrained(model_dir, tokenizer=tokenizer, **kwargs)

    def _audio(self, waves: list[np.ndarray], mm: dict[str, torch.Tensor]) -> list[int]:
        """Whisper features of `waves` into mm; -> audio tokens per wave.

        One call for all of the request's audio, as transformers does: padded to the longest
        (the padding is silence after each audio, masked out), never truncated. The features
        of a shorter audio near its end depend on that padding, so calling per audio would not
        give the reference's values."""
        if not waves:
            return []
        fe = self.feature_extractor
        # Whisper's STFT reflect-pads by n_fft / 2, which needs a longer signal than that.
        if max(len(w) for w in waves) <= fe.n_fft // 2:
            raise MediaError(f"an audio is too short (under {(fe.n_fft // 2 + 1) / fe.sampling_rate:.3f} s)")
        out = fe(waves, sampling_rate=fe.sampling_rate, padding="longest", truncation=False,
                 return_attention_mask=True, return_tensors="pt")
        mm["input_features"] = out["input_features"].to(torch.float32)
        mm["feature_attention_mask"] = out["attention_mask"].to(torch.int32)
        tokens = [audio_tokens_for_frames(int(n), self.n_window) for n in mm["feature_attention_mask"].sum(-1)]
        if min(tokens) <= 0:  # the encoder would get an empty sequence
            raise MediaError(f"an audio is too short (under {fe.hop_length / fe.sampling_rate:.3f} s)")
        return tokens

    def _videos(self, clips, track_tokens: list[int] | None, mm) -> list[list[int]]:
        """Patchify into mm (as Qwen2.5-Omni); -> each <|video_pad|>'s expansion, merged by
        time with its audio track's `track_tokens` tokens when given (use_audio_in_video)."""
        plain = super()._videos(clips, None, mm)
        if track_tokens is None:
            return plain
        ip = self.image_processor
        return [
            # Seconds in float64 from the clip, as transformers computes them: the float32 copy
            # in mm could move a frame group across an audio token at an exact tie.
            interleave_video_audio(
                self.ids, grid, ip.merge_size, ip.temporal_patch_size / clip.sample_fps, n_audio,
                self.position_id_per_seconds,
            )
            for clip, grid, n_audio in zip(clips, mm["video_grid_thw"].tolist(), track_tokens)
        ]


def _name_tokens(tokenizer) -> None:
    """Give a tokenizer saved without `audio_token` & co. the released Qwen3-Omni names.

    The base class looks the placeholder tokens up by these names (falling back to Qwen2.5's
    strings, absent from a Qwen3 vocabulary), as transformers' processor does."""
    for attr, token in _DEFAULT_TOKENS.items():
        if not getattr(tokenizer, attr, None):
            setattr(tokenizer, attr, token)
