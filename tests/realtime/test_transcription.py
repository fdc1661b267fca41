"""POST /v1/audio/transcriptions and /v1/audio/translations through the official `openai`
client, on the demo server: the thinker alone, with the documented ASR prompt (checked against
/v1/chat/completions on the same prompt), every response_format, streaming, bad input."""
from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from tests.realtime.conftest import openai_client
from tests.realtime.signals import speech_like, wav_b64
from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME


@pytest.fixture(scope="module")
def speech():
    return base64.b64decode(wav_b64(speech_like(1.5, 16000, seed=11), 16000))


def asr_reference(client, wav: bytes, instruction: str, system: str) -> str:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                    {"type": "text", "text": instruction}]}]
    resp = client.chat.completions.create(model=DEMO_SERVED_NAME, messages=messages, modalities=["text"],
                                          temperature=0.0)
    return resp.choices[0].message.content.strip()


def test_transcription_in_every_format(demo, speech):
    client = openai_client(demo)
    expected = asr_reference(client, speech, "Transcribe the English audio into text.",
                             "You are a speech recognition model.")
    file = ("speech.wav", speech, "audio/wav")
    got = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=file, language="en")
    assert got.text == expected and got.usage.output_tokens > 0
    assert client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=file, language="en",
                                              response_format="text") == expected
    verbose = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=file, language="en",
                                                 response_format="verbose_json")
    assert verbose.text == expected and verbose.language == "english" and verbose.duration == 1.5
    assert verbose.segments[0].start == 0.0 and verbose.segments[0].end == 1.5
    srt = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=file, language="en", response_format="srt")
    assert srt == f"1\n00:00:00,000 --> 00:00:01,500\n{expected}\n\n"
    vtt = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=file, language="en", response_format="vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n{expected}\n\n"


def test_streamed_transcription_and_no_language(demo, speech):
    client = openai_client(demo)
    expected = asr_reference(client, speech, "Transcribe the audio into text.", "You are a speech recognition model.")
    stream = client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=("a.wav", speech), stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and events[-1].type == "transcript.text.done"
    assert events[-1].text == expected == "".join(deltas).strip()


def test_translation(demo, speech):
    client = openai_client(demo)
    expected = asr_reference(client, speech, "Translate the audio into English text.",
                             "You are a speech translation model.")
    got = client.audio.translations.create(model=DEMO_SERVED_NAME, file=("speech.wav", speech))
    assert got.text == expected


def test_bad_requests_are_400(demo, speech):
    client = openai_client(demo)
    for kw, param in [(dict(language="klingon"), "language"), (dict(response_format="xml"), "response_format"),
                      (dict(temperature=9), "temperature")]:
        with pytest.raises(openai.BadRequestError, match=param):
            client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=("a.wav", speech), **kw)
    with pytest.raises(openai.BadRequestError, match="decode"):
        client.audio.transcriptions.create(model=DEMO_SERVED_NAME, file=("a.wav", b"not audio at all"))
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", speech))
    r = httpx.post(f"{demo.url}/v1/audio/transcriptions", data={"model": DEMO_SERVED_NAME}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(f"{demo.url}/v1/audio/translations", files={"file": ("a.wav", io.BytesIO(speech))},
                   data={"language": "en"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "language"  # translations take no language
