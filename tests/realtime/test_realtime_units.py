"""The realtime parts that need no model: session bounds and authentication over a real
WebSocket (Starlette's test client; no response is generated), the VAD adapter against the
silero-vad package's own wrapper, G.711 against FFmpeg, streaming resampling, transcript cuts."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import av
import numpy as np
import pytest
import soxr
import torch
from fastapi import FastAPI
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tests.realtime.signals import silence, speech_like
from vllm_omni.entrypoints.openai.admission import AdmissionGate
from vllm_omni.entrypoints.openai.media_fetch import MediaPolicy
from vllm_omni.entrypoints.openai.metrics import ServerMetrics
from vllm_omni.entrypoints.openai.realtime.audio import AudioFormat, InputAudioStream, to_float
from vllm_omni.entrypoints.openai.realtime.conversation import cut_transcript
from vllm_omni.entrypoints.openai.realtime.endpoint import RealtimeEndpoint
from vllm_omni.entrypoints.openai.realtime.limits import RealtimeLimits
from vllm_omni.entrypoints.openai.realtime.session_config import ModelAbilities
from vllm_omni.entrypoints.openai.realtime.vad import FRAME, SileroStream
from vllm_omni.entrypoints.openai.serving_base import PipelineShape, ServingContext


def app(limits: RealtimeLimits, api_key: str | None = None) -> FastAPI:
    shape = PipelineShape(1, 0, {"text": 0}, {0: frozenset()})
    ctx = ServingContext(engine=None, shape=shape, served_names=["m"], gate=AdmissionGate(1, 1, 1.0),
                         metrics=ServerMetrics({0: "thinker"}), media=MediaPolicy(), model_path="/nonexistent")
    a = FastAPI()
    a.add_api_websocket_route("/v1/realtime", RealtimeEndpoint(ctx, ModelAbilities(("m",), False, ()), limits,
                                                                api_key))
    return a


def events_until_close(ws) -> list[dict]:
    out = []
    try:
        while True:
            out.append(json.loads(ws.receive_text()))
    except WebSocketDisconnect as e:
        out.append({"closed": e.code})
    return out


def test_an_idle_session_is_told_and_closed():
    with TestClient(app(RealtimeLimits(idle_timeout_s=0.5))) as client, client.websocket_connect("/v1/realtime") as ws:
        got = events_until_close(ws)
    assert got[0]["type"] == "session.created" and got[0]["session"]["output_modalities"] == ["text"]
    assert got[1]["type"] == "error" and got[1]["error"]["code"] == "session_idle_timeout"
    assert got[2] == {"closed": 1000}


def test_a_session_ends_at_its_maximum_duration_even_when_active():
    with TestClient(app(RealtimeLimits(max_session_s=1.0, idle_timeout_s=0.4))) as client, \
            client.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
        for _ in range(6):  # events keep it from idling, not from expiring
            ws.send_text(json.dumps({"type": "input_audio_buffer.clear"}))
            assert json.loads(ws.receive_text())["type"] == "input_audio_buffer.cleared"
            time.sleep(0.15)
        got = events_until_close(ws)
    assert got[0]["error"]["code"] == "session_expired" and got[-1] == {"closed": 1000}


def test_sessions_are_bounded_and_the_model_checked():
    with TestClient(app(RealtimeLimits(max_sessions=1))) as client, client.websocket_connect("/v1/realtime") as first:
        first.receive_text()
        with client.websocket_connect("/v1/realtime") as second:
            got = events_until_close(second)
        assert got[0]["error"]["code"] == "too_many_sessions" and got[1] == {"closed": 1013}
    with TestClient(app(RealtimeLimits())) as client, client.websocket_connect("/v1/realtime?model=gpt-4o") as ws:
        got = events_until_close(ws)
    assert got[0]["error"]["code"] == "model_not_found" and got[1] == {"closed": 1008}


def test_the_api_key_by_header_or_browser_subprotocol():
    with TestClient(app(RealtimeLimits(), api_key="k")) as client:
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer wrong"}):
                pass
        assert refused.value.code == 1008
        with client.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer k"}) as ws:
            assert json.loads(ws.receive_text())["type"] == "session.created"
        with client.websocket_connect("/v1/realtime", subprotocols=["realtime", "openai-insecure-api-key.k"]) as ws:
            assert ws.accepted_subprotocol == "realtime"
            assert json.loads(ws.receive_text())["type"] == "session.created"


def test_vad_probabilities_equal_the_silero_package():
    from silero_vad import load_silero_vad

    wave = np.concatenate([silence(0.5, 16000), speech_like(1.0, 16000), silence(0.5, 16000)])
    reference = load_silero_vad()
    expected = [float(reference(torch.from_numpy(wave[i:i + FRAME]), 16000).detach())
                for i in range(0, wave.size - FRAME + 1, FRAME)]
    stream = SileroStream()
    got = stream.probabilities(wave[:FRAME * 20]) + stream.probabilities(wave[FRAME * 20:])  # state carries over
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert max(got) > 0.9 and max(got[:10]) < 0.3  # speech found, silence not


@pytest.mark.parametrize("kind,codec", [("audio/pcmu", "pcm_mulaw"), ("audio/pcma", "pcm_alaw")])
def test_g711_decodes_as_ffmpeg_does(kind, codec):
    raw = bytes(range(256))
    with av.open(io.BytesIO(raw), format={"pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}[codec],
                 options={"sample_rate": "8000"}) as container:
        ffmpeg = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    expected = ffmpeg.astype(np.float32) / 32768.0 if ffmpeg.dtype == np.int16 else ffmpeg
    np.testing.assert_array_equal(to_float(raw, AudioFormat(kind, 8000)), expected)


def test_chunked_input_resamples_like_the_whole():
    wave = speech_like(1.0, 48000)
    pcm = np.clip(np.round(wave * 32767), -32768, 32767).astype("<i2")
    stream = InputAudioStream(AudioFormat("audio/pcm", 48000))
    parts = [stream.decode(base64.b64encode(c.tobytes()).decode()) for c in np.array_split(pcm, 9)] + [stream.flush()]
    whole = soxr.resample(pcm.astype(np.float32) / 32768.0, 48000, 16000, quality="HQ")
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_transcript_cuts():
    text = "one two three four"
    assert cut_transcript(text, 1000, 1000) == text
    assert cut_transcript(text, 0, 1000) == "" and cut_transcript(text, 0, 0) == ""
    assert cut_transcript(text, 500, 1000) == "one two"  # 9 of 18 characters, back to a word boundary


def test_a_cancellation_lost_on_the_way_still_ends_the_response():
    """A response cancelled while its send swallows the cancellation (what Python < 3.12's
    asyncio.wait_for does when its write completes at that moment: the link's send) stops at its
    next output, and ends "cancelled". A scripted engine: the run's own behaviour is under test."""
    from types import SimpleNamespace as NS

    from vllm_omni.entrypoints.openai.realtime.conversation import Item
    from vllm_omni.entrypoints.openai.realtime.response import ResponsePlan, ResponseRun

    class ScriptedEngine:
        produced = 0

        def stage_health(self):
            return []

        async def generate(self, prompt, params, **kw):
            for i in range(50):
                self.produced += 1
                ro = NS(prompt_token_ids=[1], num_cached_tokens=0,
                        outputs=[NS(token_ids=list(range(i + 1)), finish_reason=None)])
                yield NS(delta=NS(text=f" w{i}"), final_output_type="text", request_output=ro)
                await asyncio.sleep(0)

    engine = ScriptedEngine()
    ctx = ServingContext(engine=engine, shape=PipelineShape(1, 0, {"text": 0}, {0: frozenset()}), served_names=["m"],
                         gate=AdmissionGate(1, 1, 1.0), metrics=ServerMetrics({0: "thinker"}), media=MediaPolicy(),
                         model_path="/nonexistent")
    sent = []

    async def send(event):
        sent.append(event)
        if event["type"] == "response.output_text.delta" and len(sent_deltas()) == 3:
            run.cancel("client_cancelled")
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # the write completed: Python 3.11's wait_for returns its result, the cancellation is gone

    def sent_deltas():
        return [e for e in sent if e["type"] == "response.output_text.delta"]

    plan = ResponsePlan("resp_1", "conv_1", [], ("text",), None, None, None)
    run = ResponseRun(plan, Item("assistant", [], status="in_progress"), None, ctx, send)

    async def go():
        run.task = asyncio.create_task(run.run())
        await run.task

    asyncio.run(go())
    done = sent[-1]
    assert done["type"] == "response.done"
    assert done["response"]["status"] == "cancelled", done["response"]
    assert len(sent_deltas()) == 3 and engine.produced < 50
