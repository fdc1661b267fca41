"""The API server on the tiny Qwen2.5-Omni (thinker -> talker -> token2wav), through the official
`openai` client: text and speech equal to what `Omni.generate` returns for the same request,
streaming, input media, every error status, 16 concurrent requests, disconnects, /metrics.

The server runs real stage processes (the last test kills one); the reference `Omni` runs in
this process (started while the server boots) with the same stage overrides and its stages as
threads; outputs are compared exactly (speech after the 16-bit PCM encoding).
"""
from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.conftest import in_threads
from tests.multimodal.media_files import audio_bytes, image_bytes, mp4_bytes
from tests.pipeline.conftest import wait_until
from tests.server.conftest import ServerProcess, free_port

NAME = "tiny-omni"
KEY = "test-key"
SR = 24000
# Short outputs keep the module fast: 12 thinker tokens, 48 talker codes (~0.1 s of speech).
OVERRIDES = {"0": {"default_sampling_params": {"max_tokens": 12}},
             "1": {"default_sampling_params": {"max_tokens": 48}}}
MAX_MEDIA_BYTES = 1_000_000
TALKER_VOCAB = 8448  # the tiny talker's codec vocabulary (stop on any code -> no codes at all)


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


@dataclass
class Env:
    server: ServerProcess
    omni: object  # vllm_omni.Omni, the reference
    client: openai.OpenAI
    media: Path  # --allowed-local-media-path
    http_url: str  # a local http server over `media`

    def reference(self, messages, params=None, modalities=None, voice=None,
                  **prompt_keys) -> tuple[str | None, np.ndarray | None]:
        prompt = {"messages": messages, **({"speaker": voice} if voice else {}), **prompt_keys}
        outs = self.omni.generate(prompt, params, modalities=modalities, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        by_type = {o.final_output_type: o.request_output.outputs[0] for o in outs}
        text = by_type["text"].text if "text" in by_type else None
        audio = by_type["audio"].multimodal_output["audio"].numpy() if "audio" in by_type else None
        return text, audio


@pytest.fixture(scope="module")
def env(tiny_model, tmp_path_factory):
    import json

    from vllm_omni import Omni

    model = tiny_model("qwen2_5_omni")
    tmp = tmp_path_factory.mktemp("omni-server")
    media = tmp / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(image_bytes(seed=1))
    (media / "voice.wav").write_bytes(audio_bytes("WAV", seconds=0.5, sr=16000))
    (media / "big.bin").write_bytes(b"\0" * (MAX_MEDIA_BYTES + 1))
    (tmp / "secret.wav").write_bytes(audio_bytes("WAV", seconds=0.2, sr=16000))
    server = ServerProcess.launch(
        [str(model), "--served-model-name", NAME, "--api-key", KEY, "--stage-overrides", json.dumps(OVERRIDES),
         "--allowed-local-media-path", str(media), "--max-media-bytes", str(MAX_MEDIA_BYTES),
         "--media-fetch-timeout", "5", "--allow-private-media-urls"], tmp / "server.log")  # media from 127.0.0.1
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), partial(_QuietHandler, directory=str(media)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        omni = Omni(model=str(model), stage_overrides=in_threads(3, OVERRIDES))  # loads while the server starts
        try:
            server.wait_ready()
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
            yield Env(server, omni, client, media, f"http://127.0.0.1:{httpd.server_address[1]}")
        finally:
            omni.close()
    finally:
        httpd.shutdown()
        server.stop()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def wav_samples(b64: str, fmt: str = "wav") -> np.ndarray:
    """int16 samples of a base64 wav/flac (checks 24 kHz mono) or pcm16 payload."""
    raw = base64.b64decode(b64)
    if fmt == "pcm16":
        return np.frombuffer(raw, dtype="<i2")
    data, rate = sf.read(io.BytesIO(raw), dtype="int16")
    assert rate == SR and data.ndim == 1
    return data


def pcm16(wave: np.ndarray) -> np.ndarray:
    """What 16-bit PCM encoding keeps of a float waveform (libsndfile's conversion)."""
    return np.clip(np.floor(wave.astype(np.float32) * 32768.0), -32768, 32767).astype(np.int16)


def audio_of(choice) -> dict:
    audio = choice.message.audio
    return {"data": audio.data, "transcript": audio.transcript, "id": audio.id, "expires_at": audio.expires_at}


# ------------------------------------------------------------------------------------ basics


def test_health_models_version_and_api_key(env):
    health = env.server.get("/health").json()  # open without the key, like /metrics and /version
    assert [s["state"] for s in health["stages"]] == ["up", "up", "up"]
    assert [s["model_stage"] for s in health["stages"]] == ["thinker", "talker", "code2wav"]
    assert env.server.get("/version").status_code == 200
    models = env.client.models.list().data
    assert [m.id for m in models] == [NAME]
    bad = openai.OpenAI(base_url=f"{env.server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert env.server.post("/v1/chat/completions", {"messages": user("hi")}).status_code == 401


def test_text_only_equals_omni(env):
    resp = env.client.chat.completions.create(model=NAME, messages=user("Hello!"), modalities=["text"])
    text, _ = env.reference(user("Hello!"), modalities=["text"])
    assert len(resp.choices) == 1 and resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens > 0


def test_text_and_audio_equal_omni(env):
    resp = env.client.chat.completions.create(
        model=NAME, messages=user("Say something."), modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, temperature=0.8, seed=11, max_tokens=9)
    text, audio = env.reference(user("Say something."), [{"temperature": 0.8, "seed": 11, "max_tokens": 9},
                                                          None, None], voice="Ethan")
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content == text and resp.usage.completion_tokens == 9
    got = audio_of(resp.choices[1])
    assert got["transcript"] == text and got["id"].startswith("audio-") and got["expires_at"] > 0
    samples = wav_samples(got["data"])
    assert audio.size > 0 and np.array_equal(samples, pcm16(audio))
    assert np.abs(samples / 32768.0 - audio).max() <= 1.0 / 32768 + 1e-6


def test_audio_only_has_the_transcript(env):
    resp = env.client.chat.completions.create(model=NAME, messages=user("Hi"), modalities=["audio"])
    text, audio = env.reference(user("Hi"))
    assert len(resp.choices) == 1 and resp.choices[0].message.content is None
    got = audio_of(resp.choices[0])
    assert got["transcript"] == text and np.array_equal(wav_samples(got["data"]), pcm16(audio))


def test_stream_text_deltas_then_audio_chunks(env):
    kw = dict(model=NAME, messages=user("Stream please"), audio={"format": "pcm16", "voice": "Chelsie"})
    full = env.client.chat.completions.create(**kw)
    chunks, arrived = [], []
    for chunk in env.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
        arrived.append(time.monotonic())
    text_chunks = [c for c in chunks if c.choices and c.choices[0].index == 0 and c.choices[0].delta.content]
    audio_chunks = [c for c in chunks if c.choices and c.choices[0].index == 1]
    assert len(text_chunks) >= 2  # token deltas, as generated
    assert chunks.index(text_chunks[0]) < chunks.index(audio_chunks[0])  # text arrives before the speech
    # ... while the talker and token2wav are still working, not all at the end.
    assert arrived[chunks.index(text_chunks[0])] < arrived[chunks.index(audio_chunks[0])]
    assert "".join(c.choices[0].delta.content for c in text_chunks) == full.choices[0].message.content
    assert all(c.model_extra.get("modality") == "audio" for c in audio_chunks)
    streamed = [c.choices[0].delta.audio for c in audio_chunks]  # openai's ChoiceDeltaAudio
    pcm = np.concatenate([wav_samples(a.data, "pcm16") for a in streamed if a])
    assert np.array_equal(pcm, wav_samples(audio_of(full.choices[1])["data"], "pcm16"))
    assert audio_chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_other_audio_formats(env, fmt):
    import av

    resp = env.client.chat.completions.create(model=NAME, messages=user("Hi"), modalities=["audio"],
                                              audio={"format": fmt, "voice": "Chelsie"})
    raw = base64.b64decode(resp.choices[0].message.audio.data)
    _, audio = env.reference(user("Hi"))
    if fmt == "flac":  # lossless 16 bit (libsndfile rounds to nearest here, floors for wav)
        data, rate = sf.read(io.BytesIO(raw), dtype="int16")
        assert rate == SR and data.shape == audio.shape
        assert np.abs(data.astype(np.int32) - pcm16(audio)).max() <= 1
        return
    with av.open(io.BytesIO(raw)) as c:
        stream = c.streams.audio[0]
        assert fmt in stream.codec_context.name  # "mp3float", "opus"
        decoded = sum(frame.samples for frame in c.decode(stream))
        assert decoded >= audio.size * stream.rate // SR * 0.9  # lossy, padded: about the same length


# ------------------------------------------------------------------------------------ media


def test_media_inputs_equal_omni(env):
    """http(s) image, local-file audio, base64 input_audio, data-URL video: fetched by the
    server, processed as the same bytes sent inline to Omni."""
    png, wav = (env.media / "cat.png").read_bytes(), (env.media / "voice.wav").read_bytes()
    mp4 = mp4_bytes(n_frames=8, fps=4)
    video_url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    sent = user([
        {"type": "image_url", "image_url": {"url": f"{env.http_url}/cat.png"}},
        {"type": "audio_url", "audio_url": {"url": str(env.media / "voice.wav")}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "video_url", "video_url": {"url": video_url}},
        {"type": "text", "text": "What is all this?"},
    ])
    inline = user([
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav).decode()}},
        sent[0]["content"][2], sent[0]["content"][3], sent[0]["content"][4],
    ])
    resp = env.client.chat.completions.create(model=NAME, messages=sent, modalities=["text"])
    text, _ = env.reference(inline, modalities=["text"])
    assert resp.choices[0].message.content == text
    assert resp.usage.prompt_tokens > 100  # the media placeholders were expanded


def test_mm_processor_kwargs_reach_the_processor(env):
    mp4 = mp4_bytes(n_frames=8, fps=4, with_audio=True)
    msgs = user([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}},
                 {"type": "text", "text": "Describe the clip."}])
    kwargs = {"use_audio_in_video": True}
    resp = env.client.chat.completions.create(model=NAME, messages=msgs, modalities=["text"],
                                              extra_body={"mm_processor_kwargs": kwargs})
    text, _ = env.reference(msgs, modalities=["text"], mm_processor_kwargs=kwargs)
    assert resp.choices[0].message.content == text
    plain = env.client.chat.completions.create(model=NAME, messages=msgs, modalities=["text"])
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens  # the video's audio track became tokens
    with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs"):
        env.client.chat.completions.create(model=NAME, messages=msgs, extra_body={"mm_processor_kwargs": {"x": 1}})


@pytest.mark.parametrize("part, match", [
    ({"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}},
     "image"),
    ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(b"junk" * 9).decode()}},
     "audio"),
    ({"type": "image_url", "image_url": {"url": "ftp://host/cat.png"}}, "scheme"),
    ({"type": "hologram", "hologram": {}}, "unknown content part"),
])
def test_bad_input_is_400(env, part, match):
    with pytest.raises(openai.BadRequestError, match=match):
        env.client.chat.completions.create(model=NAME, messages=user([part]), modalities=["text"])


def test_media_policy_is_400(env):
    cases = [
        (str(env.media.parent / "secret.wav"), "outside"),  # not under --allowed-local-media-path
        (str(env.media / "missing.wav"), "no such media file"),
        (f"{env.http_url}/big.bin", "limit"),  # over --max-media-bytes
        (f"{env.http_url}/missing.png", "HTTP 404"),
    ]
    for url, match in cases:
        with pytest.raises(openai.BadRequestError, match=match):
            env.client.chat.completions.create(model=NAME, messages=user([{"type": "audio_url",
                                                                            "audio_url": {"url": url}}]))


def test_bad_parameters_and_unknown_model(env):
    for kw, match in [(dict(audio={"voice": "Nobody", "format": "wav"}), "unknown speaker"),
                      (dict(audio={"voice": "Ethan", "format": "aac"}), "audio.format"),
                      (dict(modalities=["image"]), "modalities"),
                      (dict(top_p=0.0), "top_p"),
                      (dict(messages=[]), "messages")]:
        with pytest.raises(openai.BadRequestError, match=match):
            env.client.chat.completions.create(**{"model": NAME, "messages": user("hi"), **kw})
    with pytest.raises(openai.NotFoundError):
        env.client.chat.completions.create(model="gpt-4o", messages=user("hi"))


def test_a_failing_request_fails_alone_and_keeps_its_text(env):
    # A talker that stops on every code leaves token2wav nothing to speak: the pipeline fails
    # this one request (stage 2's input), all stages stay up. The text was complete by then:
    # it comes back, with the speech's error in the audio choice (a partial response).
    params = [None, {"stop_token_ids": list(range(TALKER_VOCAB))}, None]
    partial = env.client.chat.completions.create(model=NAME, messages=user("hi"),
                                                 extra_body={"sampling_params_list": params})
    text, speech = partial.choices
    assert text.message.content and text.finish_reason in ("stop", "length")
    assert speech.finish_reason == "error" and speech.message.audio is None
    assert speech.error["code"] == 500 and "no codec codes" in speech.error["message"]
    assert text.message.content == env.client.chat.completions.create(
        model=NAME, messages=user("hi"), modalities=["text"]).choices[0].message.content
    # Asked for speech alone, nothing the client wanted was finished: the request is a 500.
    with pytest.raises(openai.InternalServerError, match="no codec codes"):
        env.client.chat.completions.create(model=NAME, messages=user("hi"), modalities=["audio"],
                                           extra_body={"sampling_params_list": params})
    # Streamed, the text is already out when the speech fails: the error comes in-band, then [DONE].
    stream = env.client.chat.completions.create(model=NAME, messages=user("hi"), stream=True,
                                                extra_body={"sampling_params_list": params})
    received = []
    with pytest.raises(openai.APIError, match="no codec codes"):
        received.extend(stream)
    assert any(c.choices and c.choices[0].delta.content for c in received)
    assert env.client.chat.completions.create(model=NAME, messages=user("hi")).choices[1].message.audio.data


# ------------------------------------------------------------------------------------ load


def test_16_concurrent_requests_equal_their_solo_runs(env):
    prompts = [user(f"Request number {i}") for i in range(16)]
    kw = dict(model=NAME, audio={"format": "pcm16", "voice": "Chelsie"}, max_tokens=6)
    solo = [env.client.chat.completions.create(messages=p, **kw) for p in prompts]

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{env.server.url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(client.chat.completions.create(messages=p, **kw) for p in prompts))

    for one, many in zip(solo, asyncio.run(together()), strict=True):
        assert many.choices[0].message.content == one.choices[0].message.content
        assert many.choices[1].message.audio.data == one.choices[1].message.audio.data


def test_stream_disconnect_aborts_every_stage(env):
    before = env.server.metric("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="499") or 0.0
    stream = env.client.chat.completions.create(model=NAME, messages=user("Go on and on"), stream=True,
                                                max_tokens=3000, extra_body={"ignore_eos": True})
    next(iter(stream))
    next(iter(stream))
    assert env.server.metric("vllm_omni:stage_num_requests", stage="0") == 1.0
    stream.close()
    assert wait_until(lambda: env.server.metric("vllm_omni:num_requests_running") == 0.0, 10.0)
    for stage in ("0", "1", "2"):
        assert wait_until(lambda s=stage: env.server.metric("vllm_omni:stage_num_requests", stage=s) == 0.0, 10.0)
    assert env.server.metric("vllm_omni:stage_kv_cache_usage_perc", stage="0") == 0.0  # KV blocks freed
    assert env.server.metric("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="499") == before + 1


def test_metrics_parse_and_count(env):
    from prometheus_client.parser import text_string_to_metric_families

    r = env.server.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="200") >= 20
    assert value("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="400") >= 5
    assert value("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="401") == 1
    assert value("vllm_omni:requests_total", endpoint="/v1/chat/completions", status="500") == 2  # one streamed
    for name in ("vllm_omni:e2e_request_latency_seconds", "vllm_omni:time_to_first_token_seconds",
                 "vllm_omni:time_to_first_audio_seconds", "vllm_omni:audio_real_time_factor"):
        assert families[name].type == "histogram"
        counts = [s.value for s in families[name].samples if s.name == f"{name}_count"]
        assert counts and sum(counts) >= 20, name
    assert value("vllm_omni:generation_tokens_total") > 100
    assert value("vllm_omni:audio_seconds_generated_total") > 0
    for stage, kind in (("0", "thinker"), ("1", "talker"), ("2", "code2wav")):
        assert value("vllm_omni:stage_up", stage=stage, model_stage=kind) == 1.0
        for gauge in ("stage_queue_depth", "stage_batch_size", "stage_num_requests"):
            assert value(f"vllm_omni:{gauge}", stage=stage, model_stage=kind) == 0.0


def test_dead_stage_is_503(env):
    """Last in the module: it kills the talker."""
    os.kill(env.server.stage_pids[1], signal.SIGKILL)
    assert wait_until(lambda: env.server.get("/health").status_code == 503, 15.0)
    assert "stage 1 (talker)" in env.server.get("/health").json()["error"]["message"]
    with pytest.raises(openai.APIStatusError, match="stage 1") as e:
        env.client.chat.completions.create(model=NAME, messages=user("hi"))
    assert e.value.status_code == 503


# ------------------------------------------- the media gate with --allow-private-media-urls
# After test_dead_stage_is_503: text only (the thinker), which needs no talker.


class _SlowDecoy(SimpleHTTPRequestHandler):
    """Serves cat.png after SLOW_S seconds and counts the requests."""

    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _SlowDecoy.hits.append(self.path)
        time.sleep(SLOW_S)
        body = image_bytes(seed=1)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


SLOW_S = 4.0


@pytest.fixture(scope="module")
def slow_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _SlowDecoy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/slow.png"
    httpd.shutdown()


def _plain_chat_seconds(env) -> float:
    started = time.monotonic()
    env.client.chat.completions.create(model=NAME, messages=user("hi"), modalities=["text"], max_tokens=2)
    return time.monotonic() - started


def test_a_slow_media_url_holds_up_no_other_request(env, slow_url):
    """Media are fetched outside anything other requests wait on: a plain chat beside a request
    whose image takes SLOW_S seconds to arrive takes about as long as alone."""
    alone = _plain_chat_seconds(env)
    slow = threading.Thread(target=env.client.chat.completions.create, kwargs=dict(
        model=NAME, messages=user([{"type": "image_url", "image_url": {"url": slow_url}}]), modalities=["text"]))
    started = time.monotonic()
    slow.start()
    time.sleep(0.3)
    beside = _plain_chat_seconds(env)
    slow.join()
    assert time.monotonic() - started >= SLOW_S  # the slow request did wait for its image
    assert beside < max(5 * alone, alone + 2.0) and beside < SLOW_S, (beside, alone)


def test_a_realtime_image_is_fetched_once_and_holds_up_no_one(env, slow_url):
    """Fetched when its item is created (through the gate, off the event loop), not again on
    every turn, and not while other requests wait."""
    import json

    import websockets

    _SlowDecoy.hits.clear()
    alone = _plain_chat_seconds(env)

    async def session() -> list[dict]:
        url = f"ws://127.0.0.1:{env.server.port}/v1/realtime"
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            async def until(kind: str) -> dict:
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                    assert event["type"] != "error", event
                    if event["type"] == kind:
                        return event

            await until("session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"output_modalities": ["text"]}}))
            await until("session.updated")
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_image", "image_url": slow_url}, {"type": "input_text", "text": "hi"}]}}))
            beside = await asyncio.to_thread(_plain_chat_seconds, env)  # while the image is on its way
            await until("conversation.item.done")
            replies = []
            for _ in range(2):
                await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 2}}))
                replies.append((await until("response.done"))["response"])
            return beside, replies

    beside, replies = asyncio.run(session())
    assert [r["status"] for r in replies] == ["incomplete", "incomplete"]  # max_output_tokens: 2
    assert replies[0]["usage"]["input_tokens"] > 20  # the image is in the prompt
    assert _SlowDecoy.hits == ["/slow.png"]  # once, for both turns
    assert beside < max(5 * alone, alone + 2.0) and beside < SLOW_S, (beside, alone)
