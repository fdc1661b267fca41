"""Bounds of every realtime session (`vllm-omni serve --realtime-*` flags, `--allowed-origins`).

A session that reaches its maximum duration or stays idle gets an `error` event
(`session_expired` / `session_idle_timeout`) and the socket is closed; audio over the buffer
limit is refused with an `error` event and the session goes on. The limits hold on the
server's clock whatever the client does: a write the client does not read within the idle
limit (or by the session's end) ends the session. A WebSocket message over `max_event_bytes`
closes the socket (1009) before it is read; the conversation keeps at most `max_items` items
and `max_text_chars` characters of text (the oldest items go first, as with audio).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RealtimeLimits:
    max_sessions: int = 100  # open sockets; more are told to retry later
    max_session_s: float = 1800.0  # OpenAI's realtime sessions also last at most 30 min (GA: 60)
    idle_timeout_s: float = 300.0  # no client event and no response running for this long
    max_input_audio_s: float = 120.0  # uncommitted audio in the buffer, or in one created item
    max_history_audio_s: float = 600.0  # user audio kept in the conversation (oldest dropped first)
    # One client event: 120 s of 24 kHz PCM16 audio in base64 (the buffer's limit) fits.
    max_event_bytes: int = 8 * 1024 * 1024
    max_items: int = 256  # conversation items kept (oldest dropped first)
    max_text_chars: int = 256 * 1024  # text kept in the conversation, instructions included
    # Browser pages of other origins that may open a session ("*": any); same-origin pages and
    # clients that send no Origin (not a browser) always may.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name != "allowed_origins" and value <= 0:
                raise ValueError(f"--realtime-{name.replace('_', '-')} must be > 0, got {value}")


def positive(kind: type) -> object:
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
    g.add_argument("--realtime-max-sessions", type=positive(int), default=d.max_sessions,
                   help="open realtime sessions at most; more are refused with an error event")
    g.add_argument("--realtime-max-session-s", type=positive(float), default=d.max_session_s,
                   help="a session's maximum duration in seconds")
    g.add_argument("--realtime-idle-timeout-s", type=positive(float), default=d.idle_timeout_s,
                   help="close a session after this many seconds without a client event or a running response")
    g.add_argument("--realtime-max-input-audio-s", type=positive(float), default=d.max_input_audio_s,
                   help="seconds of audio the input buffer (or one item) may hold")
    g.add_argument("--realtime-max-history-audio-s", type=positive(float), default=d.max_history_audio_s,
                   help="seconds of user audio a conversation keeps; the oldest audio items are dropped first")
    g.add_argument("--realtime-max-event-bytes", type=positive(int), default=d.max_event_bytes,
                   help="bytes of one client event (WebSocket message); a larger one closes the socket (1009)")
    g.add_argument("--realtime-max-items", type=positive(int), default=d.max_items,
                   help="items a conversation keeps; the oldest are dropped first")
    g.add_argument("--realtime-max-text-chars", type=positive(int), default=d.max_text_chars,
                   help="characters of text a conversation keeps (instructions included); the oldest items are "
                        "dropped first, and one item or instructions over it are refused")
    g.add_argument("--allowed-origins", nargs="+", type=_origins, default=[], metavar="ORIGIN",
                   help="browser origins (e.g. https://app.example.com, or * for any; vLLM's JSON list form "
                        "'[\"https://a.example\"]' too) whose pages may open a realtime session; pages of the "
                        "server's own origin and non-browser clients always may")


def _origins(text: str) -> list[str]:
    if not text.startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list of origins: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of origin strings")
    return value


def from_args(args: argparse.Namespace) -> RealtimeLimits:
    return RealtimeLimits(args.realtime_max_sessions, args.realtime_max_session_s, args.realtime_idle_timeout_s,
                          args.realtime_max_input_audio_s, args.realtime_max_history_audio_s,
                          args.realtime_max_event_bytes, args.realtime_max_items, args.realtime_max_text_chars,
                          tuple(origin for given in args.allowed_origins for origin in given))
