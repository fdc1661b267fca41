"""Bounds of the text-to-speech resources (`vllm-omni serve` flags), parsed once at the edge.

- `VoiceLimits`: the voices clients make (/v1/audio/voices, voices_store.py): the folder, how
  many it holds, how large and how long an uploaded sample may be.
- `SpeechStreamLimits`: the speech socket (/v1/audio/speech/stream, speech_stream.py), beside
  the realtime limits it shares (sessions, duration, idle timeout: realtime/limits.py): text a
  session may send, the size of one client frame, text received and not yet read by the talker
  (the socket stops reading beyond it), and how long the server waits for a client that does
  not read its audio before it drops the session.
- `SpeechBatchLimits`: /v1/audio/speech/batch (serving_speech_batch.py): items in one batch.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


def default_voices_folder() -> Path:
    from vllm_omni.testing.tiny_models import cache_dir  # the project's cache folder (VLLM_OMNI_CACHE)

    return cache_dir() / "voices"


def _check_positive(obj: object, flags: dict[str, str]) -> None:
    for name, flag in flags.items():
        if getattr(obj, name) <= 0:
            raise ValueError(f"{flag} must be > 0, got {getattr(obj, name)}")


@dataclass(frozen=True)
class VoiceLimits:
    folder: Path | None = None  # None: default_voices_folder()
    max_voices: int = 256  # files in the folder, this checkpoint's and others'
    max_upload_bytes: int = 10 * 1024 * 1024  # one uploaded audio file
    max_audio_s: float = 60.0  # its decoded duration

    def __post_init__(self) -> None:
        _check_positive(self, {"max_voices": "--max-voices", "max_upload_bytes": "--max-voice-bytes",
                               "max_audio_s": "--max-voice-audio-s"})

    @property
    def resolved_folder(self) -> Path:
        return self.folder if self.folder is not None else default_voices_folder()


@dataclass(frozen=True)
class SpeechStreamLimits:
    max_text_chars: int = 100_000  # text one session may send (~2 hours of speech)
    max_frame_bytes: int = 64 * 1024  # one client message
    max_pending_chars: int = 4096  # received and not yet read by the talker: the socket is not read
    send_timeout_s: float = 10.0  # a client that reads nothing for this long is dropped

    def __post_init__(self) -> None:
        _check_positive(self, {f: f"--speech-stream-{f.replace('_', '-')}" for f in self.__dataclass_fields__})


@dataclass(frozen=True)
class SpeechBatchLimits:
    max_items: int = 32  # texts in one /v1/audio/speech/batch request (all under way at once)

    def __post_init__(self) -> None:
        _check_positive(self, {"max_items": "--speech-batch-max-items"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    v, s = VoiceLimits(), SpeechStreamLimits()
    g = parser.add_argument_group("text to speech: stored voices (/v1/audio/voices) and the speech socket "
                                  "(/v1/audio/speech/stream)")
    g.add_argument("--voices-dir", default=None,
                   help="folder of the voices clients make (default: voices/ in the project cache, "
                        "~/.cache/vllm_omni or $VLLM_OMNI_CACHE)")
    g.add_argument("--max-voices", type=int, default=v.max_voices, help="voices the folder may hold")
    g.add_argument("--max-voice-bytes", type=int, default=v.max_upload_bytes,
                   help="size limit of an uploaded voice sample (an audio file)")
    g.add_argument("--max-voice-audio-s", type=float, default=v.max_audio_s,
                   help="duration limit of an uploaded voice sample, in seconds")
    g.add_argument("--speech-stream-max-text-chars", type=int, default=s.max_text_chars,
                   help="characters of text one speech socket session may send")
    g.add_argument("--speech-stream-max-frame-bytes", type=int, default=s.max_frame_bytes,
                   help="size limit of one client message on the speech socket")
    g.add_argument("--speech-stream-max-pending-chars", type=int, default=s.max_pending_chars,
                   help="characters received and not yet read by the talker before the socket stops reading")
    g.add_argument("--speech-stream-send-timeout-s", type=float, default=s.send_timeout_s,
                   help="seconds a client may leave its audio unread before the session is dropped")
    g.add_argument("--speech-batch-max-items", type=int, default=SpeechBatchLimits().max_items,
                   help="texts one POST /v1/audio/speech/batch request may hold")


def voice_limits(args: argparse.Namespace) -> VoiceLimits:
    folder = Path(args.voices_dir).expanduser() if args.voices_dir else None
    return VoiceLimits(folder, args.max_voices, args.max_voice_bytes, args.max_voice_audio_s)


def speech_batch_limits(args: argparse.Namespace) -> SpeechBatchLimits:
    return SpeechBatchLimits(args.speech_batch_max_items)


def speech_stream_limits(args: argparse.Namespace) -> SpeechStreamLimits:
    return SpeechStreamLimits(args.speech_stream_max_text_chars, args.speech_stream_max_frame_bytes,
                              args.speech_stream_max_pending_chars, args.speech_stream_send_timeout_s)
