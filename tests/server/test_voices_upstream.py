"""Upstream vLLM-Omni's TTS clients on the server of test_voices_and_stream.py (`voices_server`,
conftest.py and voices_server.py: the tiny Qwen3-TTS Base checkpoint, greedy, --api-key):

- the speech socket's upstream dialect: its events, binary audio, an inline reference in the
  session config, refused fields and the caps;
- its voice fields and answer shapes on /v1/audio/voices, kept in the voice's file;
- a sample that decodes past the voice cap (stopped while decoding, whatever the file declares);
- POST /v1/audio/speech/batch: each item as its own request, per-item errors, the item cap.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
import websockets

from tests.server.conftest import ServerProcess
from tests.server.voices_server import (
    KEY, LSB_SLACK, MAX_BATCH_ITEMS, MAX_FRAME_BYTES, MAX_VOICE_AUDIO_S, PHRASES, REF_TEXT, SPF, Client, error_of,
    wav_bytes, words, ws_url,
)


@pytest.fixture(scope="module")
def client(voices_server):
    return Client(voices_server["server"])


# ------------------------------------------------------------------ the socket in upstream vLLM-Omni's dialect

async def upstream_session(server: ServerProcess, messages: list[dict]) -> list[dict | bytes]:
    """Send upstream's messages (session.config first), then read every frame (JSON or binary)
    until the server closes."""
    frames: list[dict | bytes] = []
    async with websockets.connect(ws_url(server), additional_headers={"Authorization": f"Bearer {KEY}"},
                                  max_size=None) as ws:
        for message in messages:
            await ws.send(json.dumps(message))
        async for frame in ws:
            frames.append(frame if isinstance(frame, bytes) else json.loads(frame))
    return frames


def test_upstream_clients_speak_on_the_same_socket(client):
    """Upstream's client messages (session.config, input.text, input.done, session.close) get
    upstream's answers (audio.start, binary audio, audio.done, session.done per input.done), from
    the same session engine: the streamed PCM is the speech of the whole text at once, and a
    non-streamed utterance comes as one WAV file."""
    text, second = "".join(PHRASES), "See you soon."
    messages = [{"type": "session.config", "model": "tts", "task_type": "Base", "voice": "dora",
                 "response_format": "pcm", "stream_audio": True},
                *({"type": "input.text", "text": w} for w in words(text)), {"type": "input.done"},
                {"type": "session.config", "voice": "dora", "split_granularity": "sentence"},  # wav, one file
                {"type": "input.text", "text": second}, {"type": "input.done"},
                {"type": "input.done"},  # nothing to say: answered at once
                {"type": "session.close"}]
    frames = asyncio.run(upstream_session(client.server, messages))
    assert frames[0]["type"] == "session.created"  # ours, sent before the client chose its dialect
    shape = [f["type"] if isinstance(f, dict) else "bytes" for f in frames[1:]]
    first_end = shape.index("audio.done")
    assert shape[0] == "audio.start" and set(shape[1:first_end]) == {"bytes"}
    assert shape[first_end:] == ["audio.done", "session.done", "audio.start", "bytes", "audio.done", "session.done",
                                 "session.done"]
    json_frames = [f for f in frames[1:] if isinstance(f, dict)]
    assert json_frames[0] == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                              "sentence_text": json_frames[0]["sentence_text"], "format": "pcm",
                              "sample_rate": 24000, "channels": 1}
    assert text.startswith(json_frames[0]["sentence_text"])
    assert json_frames[1:] == [
        {"type": "audio.done", "utterance_index": 0, "sentence_index": 0},
        {"type": "session.done", "utterance_index": 0, "total_sentences": 1},
        {"type": "audio.start", "utterance_index": 1, "sentence_index": 0, "sentence_text": second, "format": "wav"},
        {"type": "audio.done", "utterance_index": 1, "sentence_index": 0},
        {"type": "session.done", "utterance_index": 1, "total_sentences": 1},
        {"type": "session.done", "utterance_index": 2, "total_sentences": 0}]
    streamed = b"".join(frames[2:first_end + 1])
    assert streamed == client.speak(text, voice="dora", non_streaming_mode=False)
    wave, rate = sf.read(io.BytesIO(frames[first_end + 4]), dtype="int16")
    expected = np.frombuffer(client.speak(second, voice="dora", non_streaming_mode=False), dtype="<i2")
    assert rate == 24000 and wave.shape == expected.shape and np.abs(wave.astype(int) - expected).max() <= 1


def test_upstream_fields_are_refused_by_name_and_the_caps_hold(client):
    async def go():
        headers = {"Authorization": f"Bearer {KEY}"}
        answers = []
        for config in ({"speaker_embedding": [0.1, 0.2]}, {"speed": 1.5},
                       {"response_format": "mp3", "stream_audio": True}, {"word_timestamps": True},
                       {"task_type": "CustomVoice"}, {"ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "hi"}):
            async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "session.config", **config}))
                answers.append(json.loads(await ws.recv()))
        async with websockets.connect(ws_url(client.server), additional_headers=headers) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.config", "voice": "dora"}))
            await ws.send(json.dumps({"type": "input.text", "text": "x" * MAX_FRAME_BYTES}))
            big = json.loads(await ws.recv())
            await ws.wait_closed()
            return answers, big, ws.close_code

    answers, big, close_code = asyncio.run(go())
    assert all(a["type"] == "error" and set(a) >= {"message", "code"} for a in answers)
    assert "'speaker_embedding'" in answers[0]["message"] and "POST /v1/audio/voices" in answers[0]["message"]
    assert answers[1]["param"] == "speed" and answers[2]["param"] == "response_format"
    assert "'word_timestamps'" in answers[3]["message"]
    assert answers[4]["param"] == "task_type" and "Base checkpoint" in answers[4]["message"]
    assert answers[5]["param"] == "ref_audio" and "cannot use the voice sample" in answers[5]["message"]
    assert (big["code"], close_code) == ("message_too_big", 1009)


# ------------------------------------------------------------------ /v1/audio/voices as upstream's clients use it

def test_upstream_voice_fields_are_stored_listed_and_answered_in_upstreams_shape(client, voices_server):
    """Upstream's upload (audio_sample, consent, name, ref_text, speaker_description) answers
    {"success": true, "voice": {...}} beside our voice object; GET lists `uploaded_voices`;
    DELETE answers `success`; the fields outlive the process (read back from the folder)."""
    from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
    from vllm_omni.entrypoints.openai.voices_store import VoiceStore
    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import voice_fingerprint

    audio = wav_bytes(1.2, pitch=170.0)
    made = client.make("upstreamer", audio, consent="consent-rec-42", ref_text=REF_TEXT,
                       speaker_description="a calm low voice")
    assert made.status_code == 200, made.text
    body = made.json()
    upstream = {"name": "upstreamer", "consent": "consent-rec-42", "created_at": body["created_at"],
                "file_size": len(audio), "mime_type": "audio/wav", "ref_text": REF_TEXT,
                "speaker_description": "a calm low voice"}
    assert body["success"] is True and body["voice"] == upstream
    assert body["object"] == "audio.voice" and body["kind"] == "cloned" and body["consent"] == "consent-rec-42"
    listed = client.http.get("/v1/audio/voices").json()
    assert upstream in listed["uploaded_voices"] and "upstreamer" in listed["voices"]
    assert client.http.get("/v1/audio/voices/upstreamer").json()["speaker_description"] == "a calm low voice"
    ckpt = voices_server["ckpt"]
    reread = VoiceStore.open(VoiceLimits(voices_server["tmp"] / "voices"), voice_fingerprint(ckpt), str(ckpt)).get("upstreamer")
    assert reread.upstream() == upstream
    too_long = client.make("upstreamer2", audio, consent="c" * 300, ref_text=REF_TEXT)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "consent"
    embedding = client.http.post("/v1/audio/voices", data={"name": "emb", "consent": "c",
                                                           "speaker_embedding": "[0.1, 0.2]"})
    assert embedding.status_code == 400 and "'speaker_embedding'" in error_of(embedding)
    deleted = client.http.delete("/v1/audio/voices/upstreamer").json()
    assert deleted["success"] is True and deleted["deleted"] is True and "upstreamer" in deleted["message"]


# ------------------------------------------------------------------ the sample goes through the media gate

def lying_flac() -> bytes:
    """15 minutes of FLAC silence (~20 kB) whose STREAMINFO declares 1 s, behind an ID3 tag:
    libsndfile refuses it, FFmpeg decodes all of it whatever the header says."""
    from tests.multimodal.media_files import flac_bomb

    flac = bytearray(flac_bomb(0.25))
    info = int.from_bytes(flac[18:26], "big") & ~((1 << 36) - 1) | 8000  # total samples: 1 s at 8 kHz
    flac[18:26] = info.to_bytes(8, "big")
    return b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(flac)


def test_a_sample_decoding_past_the_cap_stops_at_the_voice_cap(client):
    """The decoder stops at --max-voice-audio-s (the media gate's limit while decoding), not at the
    server-wide --max-audio-duration, whatever duration the file declares."""
    made = client.make("bomb", lying_flac(), ref_text=REF_TEXT)
    assert made.status_code == 400
    assert f"longer than {MAX_VOICE_AUDIO_S} s" in error_of(made) and "--max-voice-audio-s" in error_of(made)


# ------------------------------------------------------------------ POST /v1/audio/speech/batch (upstream's route)

def test_a_batch_speaks_each_item_as_its_own_request_with_per_item_errors(client):
    """Batch fields are each item's defaults (an item's own win); each result is the file its
    single request gives; a failing item is its own result; the item cap is a flag."""
    items = [{"input": PHRASES[0]}, {"input": "Nobody speaks.", "voice": "nobody"},
             {"input": PHRASES[1], "response_format": "pcm"}]
    answer = client.http.post("/v1/audio/speech/batch", json={"model": "tts", "voice": "dora", "items": items})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["total"], body["succeeded"], body["failed"]) == (3, 2, 1) and body["id"].startswith("speech-batch-")
    first, refused, third = body["results"]
    assert [r["index"] for r in body["results"]] == [0, 1, 2]
    assert refused["status"] == "error" and "unknown voice 'nobody'" in refused["error"] and refused["code"] == 400
    assert third["status"] == "success" and third["media_type"] == "audio/pcm"
    # (items run batched together: the decoder's float sums may round apart by an LSB or so)
    pcm = np.frombuffer(base64.b64decode(third["audio_data"]), dtype="<i2").astype(int)
    alone = np.frombuffer(client.speak(PHRASES[1], voice="dora"), dtype="<i2")
    assert pcm.shape == alone.shape and np.abs(pcm - alone).max() <= LSB_SLACK, np.abs(pcm - alone).max()
    assert first["status"] == "success" and first["media_type"] == "audio/wav"  # upstream's batch default
    wave, rate = sf.read(io.BytesIO(base64.b64decode(first["audio_data"])), dtype="int16")
    expected = np.frombuffer(client.speak(PHRASES[0], voice="dora"), dtype="<i2")
    assert rate == 24000 and wave.shape == expected.shape
    assert np.abs(wave.astype(int) - expected).max() <= LSB_SLACK, np.abs(wave.astype(int) - expected).max()
    assert first["usage"]["output_tokens"] == expected.size // SPF

    too_many = client.http.post("/v1/audio/speech/batch", json={"items": [{"input": "Hi."}] * (MAX_BATCH_ITEMS + 1)})
    assert too_many.status_code == 413 and "--speech-batch-max-items" in error_of(too_many)
    unknown = client.http.post("/v1/audio/speech/batch",
                               json={"items": [{"input": "Hi.", "initial_codec_chunk_frames": 4}]})
    assert unknown.status_code == 400 and "initial_codec_chunk_frames" in error_of(unknown)
    other = client.http.post("/v1/audio/speech/batch", json={"model": "nope", "items": [{"input": "Hi."}]})
    assert other.status_code == 404


def test_upstream_clients_clone_a_voice_inline_in_the_session_config(client):
    """Upstream's Base clients send ref_audio / ref_text in session.config: the session's voice is
    encoded once, as a stored voice is, and speaks as the same reference given inline."""
    wav, text = wav_bytes(0.3, rate=4000, pitch=160.0), "How are you today?"  # (within the frame cap)
    reference = {"ref_audio": base64.b64encode(wav).decode(), "ref_text": REF_TEXT}
    frames = asyncio.run(upstream_session(client.server, [
        {"type": "session.config", "response_format": "pcm", "stream_audio": True, **reference},
        {"type": "input.text", "text": text}, {"type": "input.done"}, {"type": "session.close"}]))
    assert not [f for f in frames if isinstance(f, dict) and f["type"] == "error"], frames
    streamed = b"".join(f for f in frames if isinstance(f, bytes))
    assert streamed == client.speak(text, voice="alloy", non_streaming_mode=False, **reference)
    refused = asyncio.run(upstream_session(client.server, [
        {"type": "session.config", "ref_audio": reference["ref_audio"]}, {"type": "session.close"}]))
    assert [f["param"] for f in refused if isinstance(f, dict) and f["type"] == "error"] == ["ref_text"]
