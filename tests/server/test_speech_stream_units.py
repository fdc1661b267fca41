"""The speech socket's parts that need no model: where text is cut into phrases, the text span
a chunk covers, and the sender that drops a client that does not read (speech_stream*.py).
The socket end to end: tests/server/test_voices_and_stream.py."""
from __future__ import annotations

import asyncio
import logging

import pytest

from types import SimpleNamespace

from vllm_omni.entrypoints.openai.speech_stream import _Sender
from vllm_omni.entrypoints.openai.speech_stream_protocol import PhraseCutter
from vllm_omni.entrypoints.openai.speech_stream_session import StreamConfig, Utterance
from vllm_omni.entrypoints.openai.speech_stream_upstream import UpstreamConfig, UpstreamDialect


@pytest.mark.parametrize("text, end", [
    ("Hello there", 0),  # no boundary yet
    ("Hello there. How", len("Hello there.")),  # the space stays with the next phrase
    ("Hello there.", 0),  # "." at the end may be "3.14": wait for what follows
    ("Pi is 3.14 and e is 2.71. Next", len("Pi is 3.14 and e is 2.71.")),
    ("Wait, what?! Really", len("Wait, what?!")),
    ('He said "stop." Then', len('He said "stop."')),
    ("one\ntwo", len("one\n")),
    ("你好。今天", len("你好。")),  # CJK: at once
    ("你好，世界", len("你好，")),
])
def test_phrases_end_at_punctuation_followed_by_a_space_or_at_cjk_punctuation(text, end):
    assert PhraseCutter().cut(text) == end


@pytest.mark.parametrize("text, end", [
    ("Wait, what?! Really", len("Wait, what?!")),
    ("Hello, there; how are", 0),  # clause punctuation ends no sentence
    ("你好，世界。今天", len("你好，世界。")),
])
def test_sentence_phrases_end_only_at_a_sentence_end(text, end):
    """phrase_ends="sentence" (upstream's split_granularity=sentence)."""
    assert PhraseCutter(phrase_ends="sentence").cut(text) == end


def test_a_long_text_without_punctuation_is_cut_at_a_space_within_the_cap():
    cutter = PhraseCutter(max_phrase_chars=20)
    assert cutter.cut("word " * 3) == 0
    assert cutter.cut("alpha beta gamma delta epsilon") == len("alpha beta gamma")
    assert cutter.cut("x" * 30) == 20  # no space: at the cap


def test_a_chunk_spans_the_text_its_frames_read():
    u = Utterance(id="u", start=10, end=10, prompt_read=1)
    u.token_ends = [14, 18, 25]  # three tokens handed, ending at these offsets
    u.end = 25
    assert u.read_to() == 14  # the prompt reads the first token
    u.frames = 1
    assert u.read_to() == 18
    u.frames = 9
    assert u.read_to() == 25  # never past what it was handed
    assert Utterance(id="v", start=3, end=3, prompt_read=1).read_to() == 3


def test_the_talker_goes_on_between_phrases_by_default_and_upstreams_dialect_waits_for_text():
    """Text written at speaking pace runs out between phrases: by default the talker keeps speaking
    what it read (4 frames per token read, as a session.created shows it); upstream's dialect
    speaks its text as written (0: the speech of the whole text at once)."""
    assert StreamConfig(model="tts").wire("s")["max_frames_per_token"] == 4.0
    session = SimpleNamespace(speech=SimpleNamespace(info=SimpleNamespace(task_type="CustomVoice")))
    update = UpstreamDialect(session, send=None)._update(UpstreamConfig(type="session.config", voice="dora"))
    assert update.session.max_frames_per_token == 0.0


class _StalledSocket:
    """A socket whose client reads nothing: sends never complete."""

    def __init__(self) -> None:
        self.sent = 0
        self.closed = None

    async def send_text(self, text: str) -> None:
        self.sent += 1
        if self.sent > 2:
            await asyncio.Event().wait()

    async def close(self, code: int = 1000) -> None:
        self.closed = code

    application_state = None


def test_a_client_that_does_not_read_is_dropped_after_the_send_timeout(caplog):
    async def go():
        ws = _StalledSocket()
        sender = _Sender(ws, timeout_s=0.3)
        for i in range(5):
            await sender.send({"type": "x", "i": i})
        await asyncio.wait_for(sender.dead, 5)
        await sender.send({"type": "after"})  # dropped: nobody is listening
        await sender.close()
        return ws, sender

    with caplog.at_level(logging.WARNING):
        ws, sender = asyncio.run(go())
    assert ws.sent == 3 and sender.queue.qsize() <= 3
    assert "did not read for 0.3 s" in caplog.text
