"""Bounds of every realtime session (`vllm-omni serve --realtime-*` flags).

A session that reaches its maximum duration or stays idle gets an `error` event
(`session_expired` / `session_idle_timeout`) and the socket is closed; audio over the buffer
limit is refused with an `error` event and the session goes on.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class RealtimeLimits:
    max_sessions: int = 100  # open sockets; more are told to retry later
    max_session_s: float = 1800.0  # OpenAI's realtime sessions also last at most 30 min (GA: 60)
    idle_timeout_s: float = 300.0  # no client event and no response running for this long
    max_input_audio_s: float = 120.0  # uncommitted audio in the buffer, or in one created item
    max_history_audio_s: float = 600.0  # user audio kept in the conversation (oldest dropped first)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"--realtime-{name.replace('_', '-')} must be > 0, got {value}")


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RealtimeLimits()
    g = parser.add_argument_group("realtime API (/v1/realtime)")
    g.add_argument("--realtime-max-sessions", type=_positive(int), default=d.max_sessions,
                   help="open realtime sessions at most; more are refused with an error event")
    g.add_argument("--realtime-max-session-s", type=_positive(float), default=d.max_session_s,
                   help="a session's maximum duration in seconds")
    g.add_argument("--realtime-idle-timeout-s", type=_positive(float), default=d.idle_timeout_s,
                   help="close a session after this many seconds without a client event or a running response")
    g.add_argument("--realtime-max-input-audio-s", type=_positive(float), default=d.max_input_audio_s,
                   help="seconds of audio the input buffer (or one item) may hold")
    g.add_argument("--realtime-max-history-audio-s", type=_positive(float), default=d.max_history_audio_s,
                   help="seconds of user audio a conversation keeps; the oldest audio items are dropped first")


def from_args(args: argparse.Namespace) -> RealtimeLimits:
    return RealtimeLimits(args.realtime_max_sessions, args.realtime_max_session_s, args.realtime_idle_timeout_s,
                          args.realtime_max_input_audio_s, args.realtime_max_history_audio_s)
