"""A hostile corpus through a real server: every case is a 4xx with an OpenAI-shaped body
naming what is wrong, nothing hangs, and the server serves normally afterwards.

Bodies are sent as raw bytes (httpx), so cases the `openai` client would never produce
(NaN literals, lone surrogates, invalid UTF-8, 2**64) reach the server as a hostile client
sends them.
"""
from __future__ import annotations

import json

import pytest

from tests.reliability.conftest import MAX_PROMPTS, MAX_REQUEST_BYTES, NAME, TALKER_TOKENS

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEXT = [{"role": "user", "content": "hi"}]
LONE = "\ud800"  # json.dumps writes it as the escape "\ud800", which is not valid Unicode


def chat(**body) -> dict:
    return {"model": NAME, "messages": TEXT, "max_tokens": 4, **body}


def parts(*content) -> dict:
    return chat(messages=[{"role": "user", "content": list(content)}])


def completion(**body) -> dict:
    return {"model": NAME, "max_tokens": 4, **body}


def spl(entry: int, value: dict | None) -> dict:
    lst: list = [None, None, None]
    lst[entry] = value
    return chat(sampling_params_list=lst)


# (id, endpoint, body (dict or raw bytes), status, the param or a message fragment)
CASES = [
    ("seed-2**64", CHAT, chat(seed=2**64), 400, "seed"),
    ("seed-below-int64", CHAT, chat(seed=-(2**63) - 1), 400, "seed"),
    ("max_tokens-2**64", CHAT, chat(max_tokens=2**64), 400, "max_tokens"),
    ("max_tokens-0", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens-over-stage-limit", CHAT, chat(max_tokens=65), 400, "max_tokens"),
    ("max_completion_tokens-0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("top_k--2", CHAT, chat(top_k=-2), 400, "top_k"),
    ("top_k-2**64", CHAT, chat(top_k=2**64), 400, "top_k"),
    ("n-2", CHAT, chat(n=2), 400, "n"),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-1e999", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', 400,
     "not valid JSON"),
    ("temperature-Infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400,
     "Infinity"),
    ("top_p-NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400, "NaN"),
    ("top_p-0", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p-1.5", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("min_p-2", CHAT, chat(min_p=2), 400, "min_p"),
    ("presence_penalty-3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty--3", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty-0", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens--1", CHAT, chat(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens-over-max_tokens", CHAT, chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    ("stop_token_ids--1", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop_token_ids-2**64", CHAT, chat(stop_token_ids=[2**64]), 400, "stop_token_ids"),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop"),
    ("stop-lone-surrogate", CHAT, chat(stop=[LONE]), 400, "stop"),
    ("content-lone-surrogate", CHAT, chat(messages=[{"role": "user", "content": f"a{LONE}b"}]), 400,
     "messages.0.content"),
    ("text-part-lone-surrogate", CHAT, parts({"type": "text", "text": LONE}), 400, "messages.0.content.0.text"),
    ("key-lone-surrogate", CHAT, chat(**{LONE: 1}), 400, "not valid Unicode"),
    ("unsupported-field", CHAT, chat(tools=[]), 400, "tools"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("messages-missing", CHAT, {"model": NAME}, 400, "messages"),
    ("role-unknown", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role"),
    ("part-type-unknown", CHAT, parts({"type": "hologram", "hologram": {}}), 400, "unknown content part"),
    ("input_audio-format", CHAT, parts({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "xyz"}}),
     400, "messages.0.content.0.input_audio.format"),
    ("input_audio-base64", CHAT, parts({"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}),
     400, "base64"),
    ("image_url-scheme", CHAT, parts({"type": "image_url", "image_url": {"url": "ftp://host/cat.png"}}), 400,
     "scheme"),
    ("image_url-local-file", CHAT, parts({"type": "image_url", "image_url": {"url": "/etc/passwd"}}), 400,
     "local media files are not allowed"),
    ("image_url-loopback", CHAT, parts({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}),
     400, "not a public internet address"),
    ("audio_url-cloud-metadata", CHAT,
     parts({"type": "audio_url", "audio_url": {"url": "http://169.254.169.254/latest/meta-data/"}}), 400,
     "not a public internet address"),
    ("audio-format", CHAT, chat(audio={"voice": "Ethan", "format": "aac"}), 400, "audio.format"),
    ("audio-voice", CHAT, chat(audio={"voice": "Nobody", "format": "wav"}), 400, "unknown speaker"),
    ("modalities", CHAT, chat(modalities=["image"]), 400, "modalities"),
    ("stream-not-bool", CHAT, chat(stream=5), 400, "stream"),
    ("model-unknown", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("spl-length", CHAT, chat(sampling_params_list=[None]), 400, "sampling_params_list"),
    ("spl-over-talker-limit", CHAT, spl(1, {"max_tokens": TALKER_TOKENS + 1}), 400,
     "sampling_params_list[1].max_tokens"),
    ("spl-unbounded-max_tokens", CHAT, spl(1, {"max_tokens": None}), 400, "sampling_params_list[1].max_tokens"),
    ("spl-seed-2**64", CHAT, spl(0, {"seed": 2**64}), 400, "sampling_params_list[0].seed"),
    ("spl-unknown-field", CHAT, spl(2, {"bogus": 1}), 400, "sampling_params_list[2].bogus"),
    ("spl-temperature-string", CHAT, spl(1, {"temperature": "x"}), 400, "sampling_params_list[1].temperature"),
    ("spl-ignore_eos-string", CHAT, spl(1, {"ignore_eos": "yes"}), 400, "sampling_params_list[1].ignore_eos"),
    ("mm_processor_kwargs-unknown", CHAT, chat(mm_processor_kwargs={"x": 1}), 400, "mm_processor_kwargs"),
    ("json-truncated", CHAT, b'{"messages": [', 400, "not valid JSON"),
    ("json-empty", CHAT, b"", 400, "empty"),
    ("json-not-object", CHAT, b"[1, 2]", 400, "body"),
    ("json-invalid-utf8", CHAT, b'{"messages": "\xff\xfe"}', 400, "not valid JSON"),
    ("json-nested-too-deep", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("too-many-messages", CHAT, chat(messages=[{"role": "user", "content": ""}] * 5000), 413, "messages"),
    ("prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": "hello " * 200_000}]), 413, "messages"),
    ("body-over-limit", CHAT, chat(messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]), 413,
     "--max-request-bytes"),
    ("completion-empty-prompt", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("completion-oov-token", COMPLETIONS, completion(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("completion-negative-token", COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    ("completion-token-2**64", COMPLETIONS, completion(prompt=[5, 2**64]), 400, "prompt"),
    ("completion-oov-in-batch", COMPLETIONS, completion(prompt=[[5, 6], [7, 10**6]]), 400, "prompt"),
    ("completion-too-many-prompts", COMPLETIONS, completion(prompt=["hi"] * (MAX_PROMPTS + 1)), 400, "prompt"),
    ("completion-2000-prompts", COMPLETIONS, completion(prompt=[[5]] * 2000), 400, "prompt"),
    ("completion-stream-batch", COMPLETIONS, completion(prompt=["a", "b"], stream=True), 400, "prompt"),
    ("completion-lone-surrogate", COMPLETIONS, completion(prompt=f"x{LONE}"), 400, "prompt"),
    ("completion-seed-2**64", COMPLETIONS, completion(prompt="hi", seed=2**64), 400, "seed"),
    ("completion-multi_modal_data", COMPLETIONS, completion(prompt="hi", multi_modal_data={"image": "x"}), 400,
     "multi_modal_data"),
    ("image_url-second-source", CHAT, parts({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="},
                                             "image": "/etc/passwd"}), 400, "messages.0.content.0.image"),
    ("video_url-unknown-key", CHAT, parts({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="},
                                           "frames": 8}), 400, "messages.0.content.0.frames"),
    ("image_url-audio-data-url", CHAT, parts({"type": "image_url", "image_url": {"url": "data:audio/wav;base64,AA=="}}),
     400, "cannot be image media"),
    ("image_url-min_pixels-0", CHAT, parts({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="},
                                            "min_pixels": 0}), 400, "messages.0.content.0.min_pixels"),
]


def _id(case) -> str:
    return case[0]


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_bad_input_is_a_4xx_naming_the_problem(server, case):
    _, endpoint, body, status, names = case
    r = server.post(endpoint, body, timeout=30.0)
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]  # OpenAI's shape, as the openai client parses it
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["type"].endswith("Error")
    assert names in (error["param"] or "") or names in error["message"], error


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """By Content-Length at once; a chunked body (no length) by counting what arrives."""
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}])).encode()

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    for content in (big, chunks()):
        r = server.post(CHAT, content)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_the_server_still_serves(server):
    server.assert_serving()
