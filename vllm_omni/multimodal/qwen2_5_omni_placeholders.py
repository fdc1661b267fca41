"""Placeholder expansion and audio features for Qwen2.5-Omni prompts (no media IO).

Token-level versions of transformers' Qwen2_5OmniProcessor rules. Expanding ids instead of
text gives the same ids: the placeholders are special tokens, which the tokenizer never
merges with their neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class OmniTokenIds:
    audio: int
    image: int
    video: int
    audio_bos: int
    audio_eos: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "OmniTokenIds":
        # The released tokenizer names them (tokenizer.audio_token, ...); fall back to the
        # Qwen2.5-Omni token strings for tokenizers saved without those attributes.
        def tid(attr: str, default: str) -> int:
            token = getattr(tokenizer, attr, None) or default
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {token} token: not a Qwen2.5-Omni tokenizer")
            return int(token_id)

        return cls(
            audio=tid("audio_token", "<|AUDIO|>"),
            image=tid("image_token", "<|IMAGE|>"),
            video=tid("video_token", "<|VIDEO|>"),
            audio_bos=tid("audio_bos_token", "<|audio_bos|>"),
            audio_eos=tid("audio_eos_token", "<|audio_eos|>"),
        )


def audio_tokens_for_frames(num_frames: int) -> int:
    """Audio encoder outputs for `num_frames` mel frames (conv stride 2, then pooling by 2)."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def whisper_features(feature_extractor, waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel features of each 16 kHz waveform -> (input_features [N, mels, T], mask [N, T]).

    transformers pads every audio to the extractor's maximum (300 s for Qwen2.5-Omni: 30000
    frames, ~15 MB per audio) and masks the padding. Only the masked-in frames reach the
    encoder, so we return those, padded to the longest audio. They are identical to the
    reference's: the waveform is zero-padded by n_fft + hop samples, enough that every kept
    frame's window sees the same samples, and the extra frames are silent, so they cannot
    change the per-audio maximum that Whisper's log-mel clamps against.
    """
    hop, n_fft, n_max = feature_extractor.hop_length, feature_extractor.n_fft, feature_extractor.n_samples
    feats = []
    for wave in waves:
        wave = wave[:n_max]  # the reference truncates at n_samples too
        n = len(wave)
        padded = np.zeros(min(n + n_fft + hop, n_max), dtype=np.float32)
        padded[:n] = wave
        out = feature_extractor(
            [padded], sampling_rate=feature_extractor.sampling_rate, padding="longest",
            return_attention_mask=False, return_tensors="np",
        )
        feats.append(out["input_features"][0][:, : math.ceil(n / hop)])
    longest = max(f.shape[1] for f in feats)
    input_features = torch.zeros(len(feats), feats[0].shape[0], longest, dtype=torch.float32)
    mask = torch.zeros(len(feats), longest, dtype=torch.int32)
    for i, f in enumerate(feats):
        input_features[i, :, : f.shape[1]] = torch.from_numpy(f)
        mask[i, : f.shape[1]] = 1
    return input_features, mask


def _chunk_sizes(values: np.ndarray, tokens_per_chunk: int) -> list[int]:
    """Sizes of the runs of `values` (increasing) falling in successive windows of
    tokens_per_chunk. Same as Qwen2_5OmniProcessor.get_chunked_index, including its quirk:
    a jump over several windows still opens only one new chunk."""
    sizes, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value >= chunk * tokens_per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(values) - start)
    return sizes


def video_with_audio_ids(
    ids: OmniTokenIds,
    grid_thw: list[int],
    merge_size: int,
    second_per_grid: float,
    num_audio_tokens: int,
    position_id_per_seconds: float = 25,
    seconds_per_chunk: float = 2.0,
) -> list[int]:
    """use_audio_in_video: the <|VIDEO|> placeholder becomes <|audio_bos|>, then per time chunk
    (seconds_per_chunk) that chunk's video tokens followed by its audio tokens, <|audio_eos|>.
    Video token times are their frame group's start (t * second_per_grid); audio tokens are
    1 / position_id_per_seconds s apart."""
    t, h, w = grid_thw
    per_frame = (h // merge_size) * (w // merge_size)
    video_times = np.repeat(np.arange(t), per_frame) * second_per_grid * position_id_per_seconds
    tokens_per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    video_chunks = _chunk_sizes(video_times, tokens_per_chunk)
    audio_chunks = _chunk_sizes(np.arange(num_audio_tokens), tokens_per_chunk)
    out = [ids.audio_bos]
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            out += [ids.video] * video_chunks[j]
        if j < len(audio_chunks):
            out += [ids.audio] * audio_chunks[j]
    out.append(ids.audio_eos)
    return out


def count_placeholders(prompt_ids: list[int], ids: OmniTokenIds) -> dict[str, int]:
    return {
        "image": prompt_ids.count(ids.image),
        "audio": prompt_ids.count(ids.audio),
        "video": prompt_ids.count(ids.video),
    }


def expand(
    prompt_ids: list[int],
    ids: OmniTokenIds,
    image_lengths: list[int],
    audio_lengths: list[int],
    video_expansions: list[list[int]],
) -> list[int]:
    """Replace each placeholder by its expansion, in prompt order per modality: the i-th
    <|IMAGE|> by image_lengths[i] image tokens, <|AUDIO|> likewise, and the i-th <|VIDEO|>
    by video_expansions[i] (plain video tokens, or the interleaved sequence)."""
    out: list[int] = []
    counters = {"image": 0, "audio": 0, "video": 0}
    for token in prompt_ids:
        if token == ids.image:
            out += [ids.image] * image_lengths[counters["image"]]
            counters["image"] += 1
        elif token == ids.audio:
            out += [ids.audio] * audio_lengths[counters["audio"]]
            counters["audio"] += 1
        elif token == ids.video:
            out += video_expansions[counters["video"]]
            counters["video"] += 1
        else:
            out.append(token)
    return out
