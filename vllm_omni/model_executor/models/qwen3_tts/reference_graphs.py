"""A cloned voice's two reference encoders as CUDA graphs, one per reference-length bucket.

A reference the talker has not seen runs the speaker encoder and Mimi's encoder before the
request's first step. Eagerly they launch ~270 and ~650 small kernels: on the H200 ~6 and
~17-25 ms of launches for 2-10 s of audio, against ~1 and ~2.5 ms replayed from a graph
(benchmarks/bench_tts_reference.py). Both encoders give a padded input's real part the result
of the input alone (`SpeakerEncoder(mel, length)`, `SpeechEncoder.encode_padded`), so a graph
per bucket of padded length serves every reference up to the largest bucket; a longer one,
or a shorter one than the speaker encoder's reflection needs, runs eagerly.
"""
from __future__ import annotations

import logging
import math

import torch

from vllm_omni.model_executor.device_copy import to_device_nowait
from vllm_omni.model_executor.graph_capture import capture_buckets
from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import (
    HOP, NUM_MELS, SAMPLE_RATE, SpeakerEncoder, mel_spectrogram,
)
from vllm_omni.model_executor.models.qwen3_tts.speech_encoder import SpeechEncoder

logger = logging.getLogger(__name__)

# Padded reference lengths. A graph costs about the same at any of them (launch-bound), and qwen-tts
# asks for references of a few seconds.
BUCKET_SECONDS = (2, 4, 6, 8, 10, 12, 16, 20)


class ReferenceGraphs:
    def __init__(self, speaker: SpeakerEncoder, speech: SpeechEncoder) -> None:
        self.speaker, self.speech = speaker, speech
        spf = speech.samples_per_frame
        self.buckets = [math.ceil(s * SAMPLE_RATE / spf) * spf for s in BUCKET_SECONDS]  # samples
        device = speaker.fc.weight.device
        self.mel = torch.zeros(1, self.buckets[-1] // HOP, NUM_MELS, dtype=speaker.fc.weight.dtype, device=device)
        self.mel_frames = torch.zeros((), dtype=torch.long, device=device)
        self.audio = torch.zeros(self.buckets[-1], dtype=next(speech.mimi.parameters()).dtype, device=device)
        self.audio_samples = torch.zeros((), dtype=torch.long, device=device)
        self._speaker_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._speaker_rows: dict[int, torch.Tensor] = {}
        self._codes_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._codes: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        def full(samples: int) -> None:  # warm-up and capture on a whole bucket of silence
            self.mel_frames.fill_(samples // HOP)
            self.audio_samples.fill_(samples)

        self._speaker_graphs, self._speaker_rows = capture_buckets(
            self.buckets, lambda samples: self.speaker(self.mel[:, :samples // HOP], self.mel_frames)[0], full)
        self._codes_graphs, self._codes = capture_buckets(
            self.buckets, lambda samples: self.speech.encode_padded(self.audio[:samples], self.audio_samples), full)
        logger.info("captured the reference encoders' CUDA graphs for %s s of audio", BUCKET_SECONDS)

    def _bucket(self, samples: int) -> int | None:
        return next((b for b in self.buckets if b >= samples), None)

    def embed_speaker(self, audio: torch.Tensor) -> torch.Tensor | None:
        """`SpeakerEncoder.embed(audio)` from a graph; None where no graph takes it."""
        bucket = self._bucket(audio.shape[0])
        if bucket is None:
            return None
        mel = mel_spectrogram(audio.float().cpu())
        if mel.shape[0] <= self.speaker.max_reflect_padding:
            return None
        self.mel[0, :mel.shape[0]].copy_(to_device_nowait(mel, self.mel.device))
        self.mel_frames.fill_(mel.shape[0])
        self._speaker_graphs[bucket].replay()
        return self._speaker_rows[bucket].clone()

    def encode_codes(self, audio: torch.Tensor) -> torch.Tensor | None:
        """`SpeechEncoder.encode(audio)` from a graph; None where no graph takes it."""
        samples = audio.shape[0]
        bucket = self._bucket(samples)
        if bucket is None:
            return None
        self.audio[:samples].copy_(to_device_nowait(audio, self.audio.device))
        self.audio_samples.fill_(samples)
        self._codes_graphs[bucket].replay()
        return self._codes[bucket][:-(-samples // self.speech.samples_per_frame)].clone()
