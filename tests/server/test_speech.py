"""POST /v1/audio/speech and GET /v1/audio/voices on real `vllm-omni serve` processes with the tiny
Qwen3-TTS checkpoints (one server per task type, its two stages as threads of the server), through
the official `openai` client.

- every response format decodes to the same speech (wav/pcm: the same 16-bit samples, flac
  within 1 LSB; mp3/opus/aac: the same duration);
- both stream formats concatenate into the non-streamed audio (pcm: byte for byte);
- 8 concurrent requests each equal their solo run;
- VoiceDesign (instructions) and Base (ref_audio as a data URL, bare base64 and an http URL);
- errors: unknown voice (400 naming the voices), empty (400) and over-long (413) input, over-long
  instructions (400 above --tts-max-instructions-length), bad reference audio (400), a
  streaming format that cannot stream (400); a --task-type that does not match the checkpoint
  stops `serve` before any model loads.
"""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.multimodal.media_files import flac_bomb
from tests.conftest import in_threads
from tests.server.conftest import REPO, ServerProcess

SR = 24000
FRAMES = 12  # codec frames per request (12.5 Hz: ~1 s of speech)
MAX_INSTRUCTIONS = 40
OVERRIDES = json.dumps(in_threads(2, {"0": {"max_num_seqs": 8, "default_sampling_params": {"max_tokens": FRAMES}},
                                       "1": {"max_num_seqs": 8}}))
TEXTS = ["Hello! How are you today?", "The weather is nice today.", "What is the capital of France?",
         "Please write a short poem.", "Once upon a time.", "A journey of a thousand miles.",
         "She sells sea shells.", "Numbers: 1 2 3."]


def start(ckpt, tmp_path_factory, *extra: str) -> ServerProcess:
    log = tmp_path_factory.mktemp("speech-server") / "server.log"
    return ServerProcess.launch([str(ckpt), "--stage-overrides", OVERRIDES, *extra], log).wait_ready()


@pytest.fixture(scope="module")
def custom_voice(tiny_model, tmp_path_factory):
    server = start(tiny_model("qwen3_tts", task_type="CustomVoice"), tmp_path_factory,
                   "--served-model-name", "tts", "--tts-max-instructions-length", str(MAX_INSTRUCTIONS),
                   "--task-type", "CustomVoice")
    yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    server.stop()


def speak(client, text: str = TEXTS[0], **kw) -> bytes:
    kw.setdefault("voice", "vivian")
    return client.audio.speech.create(model="tts", input=text, **kw).content


def samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2")


def decode_av(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])


def test_voices(custom_voice):
    server, _ = custom_voice
    listed = server.get("/v1/audio/voices").json()
    assert (listed["voices"], listed["task_type"]) == (["eric", "ryan", "vivian"], "CustomVoice")
    assert [(v["name"], v["kind"]) for v in listed["data"]] == [("eric", "preset"), ("ryan", "preset"), ("vivian", "preset")]


def test_every_response_format_holds_the_same_speech(custom_voice):
    _, client = custom_voice
    pcm = samples(speak(client, response_format="pcm"))
    assert pcm.size == FRAMES * 1920 and np.abs(pcm).max() > 1000  # a real signal, not silence
    wave, rate = sf.read(io.BytesIO(speak(client, response_format="wav")), dtype="int16")
    assert rate == SR and np.array_equal(wave, pcm)
    wave, rate = sf.read(io.BytesIO(speak(client, response_format="flac")), dtype="int16")
    assert rate == SR and np.abs(wave.astype(np.int32) - pcm).max() <= 1  # libsndfile's FLAC rounds, not floors
    for fmt in ("mp3", "opus", "aac"):  # lossy: the same length of audio, give or take codec padding
        decoded = decode_av(speak(client, response_format=fmt))
        assert abs(decoded.size / 48000 * SR if fmt == "opus" else decoded.size) - pcm.size < 0.1 * SR, fmt
    other = samples(speak(client, text=TEXTS[1], response_format="pcm"))
    assert not np.array_equal(other, pcm)  # the text matters
    assert not np.array_equal(samples(speak(client, voice="ryan", response_format="pcm")), pcm)  # so does the voice
    faster = samples(speak(client, response_format="pcm", speed=2.0))
    assert abs(faster.size - pcm.size / 2) < 0.05 * SR


def test_streams_concatenate_into_the_file(custom_voice):
    _, client = custom_voice
    whole = speak(client, response_format="pcm")
    with client.audio.speech.with_streaming_response.create(
            model="tts", voice="vivian", input=TEXTS[0], response_format="pcm",
            extra_body={"stream_format": "audio"}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert b"".join(response.iter_bytes()) == whole
    with client.audio.speech.with_streaming_response.create(
            model="tts", voice="vivian", input=TEXTS[0], response_format="wav",
            extra_body={"stream_format": "audio"}) as response:
        streamed_wav = response.read()
    assert np.array_equal(sf.read(io.BytesIO(streamed_wav), dtype="int16")[0], samples(whole))
    with client.audio.speech.with_streaming_response.create(
            model="tts", voice="vivian", input=TEXTS[0], response_format="pcm", stream_format="sse") as response:
        events = [json.loads(line[len("data: "):]) for line in response.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == whole
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == FRAMES and usage["total_tokens"] == usage["input_tokens"] + FRAMES > FRAMES


def test_concurrent_requests_equal_their_solo_runs(custom_voice):
    _, client = custom_voice
    solo = [samples(speak(client, text=t, response_format="pcm")) for t in TEXTS]
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(pool.map(lambda t: samples(speak(client, text=t, response_format="pcm")), TEXTS))
    for text, a, b in zip(TEXTS, solo, together):
        assert a.shape == b.shape, text
        # Batched convolutions round differently (~1e-5); different codes would move samples by ~0.2.
        assert np.abs(a.astype(np.int32) - b).max() <= 2, text


def test_errors(custom_voice):
    _, client = custom_voice
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'nobody'.*\['eric', 'ryan', 'vivian'\]"):
        speak(client, voice="nobody")
    with pytest.raises(openai.BadRequestError, match="non-empty"):
        speak(client, text="  ")
    with pytest.raises(openai.APIStatusError) as info:
        speak(client, text="x" * 5000)
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="tts-max-instructions-length"):
        speak(client, instructions="y" * (MAX_INSTRUCTIONS + 1))
    assert speak(client, instructions="y" * MAX_INSTRUCTIONS, response_format="pcm")
    with pytest.raises(openai.BadRequestError, match="needs response_format pcm or wav"):
        speak(client, response_format="mp3", extra_body={"stream_format": "audio"})
    with pytest.raises(openai.BadRequestError, match="Base"):
        speak(client, extra_body={"ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "x"})
    with pytest.raises(openai.BadRequestError, match="speed"):
        speak(client, speed=5.0)


def test_voice_design(tiny_model, tmp_path_factory):
    """VoiceDesign through the server, greedy: the voice from `instructions` speaks what qwen-tts
    speaks (its committed fixture, tests/reference/qwen_tts), and a designed voice (a stored
    description, /v1/audio/voices) speaks as its instructions given inline."""
    from tests.models.test_qwen3_tts import REFERENCE, fixture

    case = next(c for c in fixture_cases("VoiceDesign") if c["name"] == "described_voice")
    greedy = json.dumps(in_threads(2, {"0": {"max_num_seqs": 8, "default_sampling_params": {"max_tokens": 15,
                                                                                           "temperature": 0.0}},
                                       "1": {"max_num_seqs": 8}}))
    server = ServerProcess.launch([str(tiny_model("qwen3_tts", task_type="VoiceDesign")), "--stage-overrides", greedy,
                                   "--voices-dir", str(tmp_path_factory.mktemp("designed"))],
                                  tmp_path_factory.mktemp("vd-server") / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        model = server.get("/v1/models").json()["data"][0]["id"]

        def speak(**kw) -> bytes:  # the OpenAI client always sends a voice
            return client.audio.speech.create(model=model, input=case["text"], response_format="pcm",
                                              **{"voice": "alloy", **kw}).content

        calm = speak(instructions=case["instruct"])
        reference = np.load(REFERENCE / "fixtures" / "VoiceDesign_waveforms.npz")[case["name"]]
        assert samples(calm).size == reference.size == len(fixture("VoiceDesign")["cases"][case["name"]]["codes"]) * 1920
        # (streamed code2wav chunks: within 1e-4 of the whole decode, then 16-bit PCM)
        np.testing.assert_allclose(samples(calm) / 32768, reference, rtol=0, atol=5e-4)
        assert speak(instructions="A bright young voice.") != calm
        with pytest.raises(openai.BadRequestError, match="instructions"):
            client.audio.speech.create(model=model, voice="alloy", input=TEXTS[0])

        made = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "narrator", "instructions": case["instruct"]})
        assert made.json()["kind"] == "designed" and made.json()["instructions"] == case["instruct"]
        listed = server.get("/v1/audio/voices").json()
        assert listed["voices"] == ["narrator"] and listed["task_type"] == "VoiceDesign"
        designed = client.audio.speech.with_raw_response.create(model=model, input=case["text"], voice="narrator",
                                                                response_format="pcm")
        inline = client.audio.speech.with_raw_response.create(model=model, input=case["text"], voice="alloy",
                                                              response_format="pcm", instructions=case["instruct"])
        assert designed.content == inline.content == calm
        assert designed.headers["x-vllm-omni-input-tokens"] == inline.headers["x-vllm-omni-input-tokens"]
        with pytest.raises(openai.BadRequestError, match="stored voice: give no instructions"):
            speak(voice="narrator", instructions="A bright young voice.")
        refused = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "x"},
                             files={"audio_sample": ("a.wav", b"RIFF", "audio/wav")})
        assert refused.status_code == 400 and "'instructions'" in refused.json()["error"]["message"]
    finally:
        server.stop()


def fixture_cases(task: str) -> list[dict]:
    from tests.models.test_qwen3_tts import CASES

    return CASES[task]


@pytest.fixture
def http_dir(tmp_path):
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_voice_cloning(tiny_model, tmp_path_factory, http_dir):
    folder, url = http_dir
    t = np.arange(int(1.2 * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, 0.4 * np.sin(2 * np.pi * 150 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t)), 16000, format="WAV")
    wav = buf.getvalue()
    (folder / "ref.wav").write_bytes(wav)
    # The reference is fetched from a loopback server, which the media policy refuses by default.
    server = start(tiny_model("qwen3_tts", task_type="Base"), tmp_path_factory, "--allow-private-media-urls")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        model = server.get("/v1/models").json()["data"][0]["id"]

        def clone(ref_audio: str, **extra) -> bytes:
            return client.audio.speech.create(model=model, voice="alloy", input=TEXTS[0], response_format="pcm",
                                              extra_body={"ref_audio": ref_audio, **extra}).content

        b64 = base64.b64encode(wav).decode()
        by_data_url = clone(f"data:audio/wav;base64,{b64}", ref_text="Hello there.")
        assert len(by_data_url) == FRAMES * 1920 * 2
        assert clone(b64, ref_text="Hello there.") == by_data_url
        assert clone(f"{url}/ref.wav", ref_text="Hello there.") == by_data_url
        assert clone(b64, x_vector_only_mode=True) != by_data_url
        with pytest.raises(openai.BadRequestError, match="audio"):
            clone(base64.b64encode(b"not audio at all").decode(), ref_text="x")
        with pytest.raises(openai.BadRequestError, match="ref_text"):
            clone(b64)
        with pytest.raises(openai.BadRequestError, match="ref_audio"):
            client.audio.speech.create(model=model, voice="alloy", input=TEXTS[0])
        # An hour of audio in a small FLAC: decoding stops at --max-audio-duration (600 s).
        with pytest.raises(openai.BadRequestError, match="--max-audio-duration"):
            clone(base64.b64encode(flac_bomb(hours=1.0)).decode(), ref_text="x")
        with pytest.raises(openai.BadRequestError, match="cannot be audio media"):
            clone(f"data:image/png;base64,{b64}", ref_text="x")
    finally:
        server.stop()


def test_task_type_must_match_the_checkpoint(tiny_model):
    result = subprocess.run(
        [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(tiny_model("qwen3_tts")),
         "--task-type", "Base", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "does not match the checkpoint, a CustomVoice model" in result.stderr


def test_the_server_logs_no_config_fallback_warning(custom_voice):
    server, _ = custom_voice
    # AutoTokenizer, not knowing `qwen3_tts`, read the config as a bare PretrainedConfig and warned
    # "... to instantiate a model of type ``" (issue 40); our config class is registered first now.
    assert "to instantiate a model of type" not in server.log_path.read_text()
