"""`vllm bench serve` (entrypoints/cli/bench): its figures from known timings, and how it reads
each backend's responses (an httpx transport that answers as a server would: this tests the
client's parsing; the real servers are driven in tests/server/test_server_demo.py and
tests/compat/test_server_upstream_files.py)."""
from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from vllm_omni.entrypoints.cli.bench import backends, metrics, runner
from vllm_omni.entrypoints.cli.bench.datasets import SampleRequest


def test_playback_counts_a_chunk_that_arrives_after_everything_before_it_played():
    # plays 0-1 s, then the next second until 2 s; the third arrives at 2.5 s: 0.5 s of silence
    assert metrics.playback([(0.0, 1.0), (0.5, 1.0), (2.5, 1.0), (3.0, 1.0)]) == metrics.Playback(1, 0.5)
    assert metrics.playback([(0.2, 0.5), (0.6, 0.5), (1.1, 0.5)]) == metrics.Playback(0, 0.0)
    assert metrics.playback([(0.0, 0.1), (1.0, 0.1), (3.0, 0.1)]) == metrics.Playback(2, pytest.approx(1.9))
    # which chunks came late, and by how much: the second (0.9 s) and the third (1.9 s)
    assert metrics.playback([(0.0, 0.1), (1.0, 0.1), (3.0, 0.1)]).late == ((1, pytest.approx(0.9)),
                                                                          (2, pytest.approx(1.9)))


def test_warm_up_is_the_first_tenth_rounded_up():
    assert [metrics.warmup_count(n, 0.1) for n in (1, 3, 10, 11)] == [1, 1, 1, 2]
    assert metrics.warmup_count(10, 0.0) == 0


def test_arrivals_follow_the_rate_and_the_seed():
    assert runner.arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    a = runner.arrival_offsets(4000, 20.0, 1.0, 7)
    assert a == runner.arrival_offsets(4000, 20.0, 1.0, 7) != runner.arrival_offsets(4000, 20.0, 1.0, 8)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.05, rel=0.05) and gaps.std() == pytest.approx(0.05, rel=0.1)
    bursty = np.diff(runner.arrival_offsets(4000, 20.0, 0.25, 7))  # gamma shape 1/4: same mean, burstier
    assert bursty.mean() == pytest.approx(0.05, rel=0.1) and bursty.std() > 1.5 * gaps.std()


def test_latency_samples_in_milliseconds():
    r = backends.RequestResult(success=True, latency=2.0, ttft=0.5, itl=[0.1, 0.3], text_latency=0.9,
                               output_tokens=3, audio_chunks=[(1.0, 2.0), (1.5, 2.0)])
    failed = backends.RequestResult(success=False, latency=9.0)
    assert metrics.samples([r, failed], "e2el") == [2000.0]
    assert metrics.samples([r], "tpot") == [pytest.approx(200.0)]  # (0.9 - 0.5) / (3 - 1)
    assert metrics.samples([r], "itl") == [pytest.approx(100.0), pytest.approx(300.0)]
    assert metrics.samples([r], "audio_ttfp") == [1000.0]
    assert metrics.samples([r], "audio_rtf") == [pytest.approx(1.5 / 4.0)]


def _wav(seconds: float, rate: int = 24000) -> str:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * rate), dtype=np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def _run(fn, handler, sample: SampleRequest) -> backends.RequestResult:
    target = backends.Target(url="http://server/v1/x", model="m", headers={}, extra_body={"modalities": ["audio"]},
                             ignore_eos=True, sample_rate=24000)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await fn(client, target, sample)
    return asyncio.run(go())


def test_chat_omni_reads_text_and_audio_in_both_stream_shapes():
    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        events = [{"choices": [{"index": 0, "delta": {"content": "Hi"}}], "modality": "text"},
                  {"choices": [{"index": 0, "delta": {"content": " there"}}], "modality": "text"},
                  {"choices": [{"index": 1, "delta": {"audio": {"data": _wav(0.5)}}}], "modality": "audio"},
                  {"choices": [{"index": 1, "delta": {"content": _wav(0.25)}}], "modality": "audio"},  # upstream's
                  {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    r = _run(backends.chat, handler, SampleRequest("hello", 1, 4))
    assert r.success and r.text == "Hi there" and (r.prompt_tokens, r.output_tokens) == (11, 2)
    assert [d for _, d in r.audio_chunks] == [0.5, 0.25] and len(r.itl) == 1
    assert sent["max_tokens"] == 4 and sent["ignore_eos"] and sent["stream"] and sent["modalities"] == ["audio"]


def test_speech_reads_raw_pcm_across_odd_reads():
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        async def pieces():
            yield b"\x00" * 4801
            yield b"\x00" * 4799
        return httpx.Response(200, content=pieces())

    r = _run(backends.speech, handler, SampleRequest("hello", 1, None))
    assert r.success and r.audio_seconds == pytest.approx(9600 / 48000)


def test_a_failed_request_keeps_the_servers_answer():
    r = _run(backends.chat, lambda request: httpx.Response(400, json={"error": {"message": "bad"}}),
             SampleRequest("x", 1, 1))
    assert not r.success and r.error.startswith("HTTP 400") and "bad" in r.error


def test_a_stream_that_fails_after_its_200_is_a_failed_request():
    """A stage that breaks mid-stream: the server has sent 200 and the text, then the error in-band
    (a top-level `error`, or a choice finished with one: a partial response). Neither counts as
    a success (a benchmark would report the run's failures as requests without audio)."""
    text = {"choices": [{"index": 0, "delta": {"content": "Hi"}}], "modality": "text"}
    for failure in ({"error": {"message": "stage 1: talker broke", "code": 500}},
                    {"choices": [{"index": 1, "delta": {}, "finish_reason": "error",
                                  "error": {"message": "stage 1: talker broke", "code": 500}}]}):
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in (text, failure)) + "data: [DONE]\n\n"
        r = _run(backends.chat, lambda request, body=body: httpx.Response(
            200, text=body, headers={"content-type": "text/event-stream"}), SampleRequest("x", 1, 1))
        assert not r.success and "talker broke" in r.error and r.text == "Hi"


def test_images_backend_counts_the_images_returned():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert (body["prompt"], body["n"], body["response_format"]) == ("a cat", 1, "b64_json")
        return httpx.Response(200, json={"created": 0, "data": [{"b64_json": "AAAA"}]})

    r = _run(backends.images, handler, SampleRequest("a cat", 2, None))
    assert r.success and r.images == 1 and r.latency > 0
