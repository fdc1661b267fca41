"""`GET /v1/realtime` against a real server on the embedded demo model, through a real WebSocket
client (`websockets`) and the official `openai` SDK's realtime client.

Every reply is checked against what /v1/chat/completions answers for the same conversation
(text, and speech as 16-bit PCM, exactly); chat itself is checked against `Omni` in
tests/server. Sampling is seeded per request, so equal conversations give equal replies.
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest

from tests.pipeline.conftest import wait_until
from tests.realtime.conftest import (
    MAX_HISTORY_AUDIO_S, MAX_INPUT_AUDIO_S, Realtime, chat_reference, chunks, openai_client, run, user_audio_wav,
    user_text,
)
from tests.realtime.signals import pcm16_b64, silence, speech_like, wav_b64
from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME
from vllm_omni.entrypoints.openai.realtime.conversation import cut_transcript

MANUAL = {"audio": {"input": {"turn_detection": None}}}  # the client commits and asks for replies
TOKENS = 4  # thinker tokens per reply: short replies keep the module fast

# The event order of one spoken reply (OpenAI Realtime GA), deltas left out.
SPOKEN_REPLY = ["response.created", "response.output_item.added", "conversation.item.added",
                "response.content_part.added", "response.output_audio.done", "response.output_audio_transcript.done",
                "response.content_part.done", "response.output_item.done", "conversation.item.done", "response.done"]


def skeleton(reply) -> list[str]:
    return [e["type"] for e in reply.events if not e["type"].endswith(".delta")]


def test_a_turn_by_text_equals_chat(demo):
    async def go():
        rt = await Realtime.open(demo, **MANUAL)
        item = await rt.say_text("Hello there")
        assert item["content"] == [{"type": "input_text", "text": "Hello there"}] and item["role"] == "user"
        reply = await rt.response(max_output_tokens=TOKENS)
        await rt.close()
        return reply

    reply = run(go())
    text, pcm = chat_reference(openai_client(demo), [user_text("Hello there")], TOKENS)
    assert skeleton(reply) == SPOKEN_REPLY
    assert reply.transcript == text and reply.pcm == pcm and len(pcm) > 0
    r = reply.response
    assert r["status"] == "incomplete" and r["status_details"]["reason"] == "max_output_tokens"
    assert r["usage"]["output_tokens"] == TOKENS and r["usage"]["input_tokens"] > 0
    assert r["usage"]["total_tokens"] == r["usage"]["input_tokens"] + TOKENS
    assert reply.item["content"] == [{"type": "output_audio", "transcript": text}]
    assert reply.of("response.output_audio_transcript.done")[0]["transcript"] == text


def test_a_text_only_reply(demo):
    async def go():
        rt = await Realtime.open(demo, **MANUAL, output_modalities=["text"])
        await rt.say_text("Just text")
        reply = await rt.response(max_output_tokens=TOKENS)
        await rt.close()
        return reply

    reply = run(go())
    text, _ = chat_reference(openai_client(demo), [user_text("Just text")], TOKENS, modalities=["text"])
    assert reply.text == text and not reply.pcm and not reply.of("response.output_audio_transcript.delta")
    assert reply.of("response.output_text.done")[0]["text"] == text
    assert reply.response["output_modalities"] == ["text"]


def test_a_turn_by_committed_audio_resampled_from_24k(demo):
    wave = speech_like(1.0, 24000, seed=3)

    async def go():
        rt = await Realtime.open(demo, **MANUAL)  # the default input: PCM16 at 24 kHz
        for part in chunks(wave, 7):
            await rt.send("input_audio_buffer.append", audio=pcm16_b64(part))
        await rt.send("input_audio_buffer.commit")
        committed = await rt.until("input_audio_buffer.committed")
        added = await rt.until("conversation.item.added")
        assert added["item"]["id"] == committed["item_id"] and added["item"]["role"] == "user"
        reply = await rt.response(max_output_tokens=TOKENS)
        await rt.close()
        return reply

    reply = run(go())
    # The chat API resamples the whole file at once; the session resampled it chunk by chunk.
    text, pcm = chat_reference(openai_client(demo), [user_audio_wav(wav_b64(wave, 24000))], TOKENS)
    assert reply.transcript == text and reply.pcm == pcm


def test_server_vad_finds_the_speech_between_silences(demo):
    sr = 16000
    timeline = np.concatenate([silence(0.8, sr), speech_like(1.2, sr, seed=5), silence(1.2, sr)])

    async def go():
        rt = await Realtime.open(demo, max_output_tokens=TOKENS,
                                 audio={"input": {"format": {"type": "audio/pcm", "rate": sr},
                                                  "turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}})
        for part in chunks(timeline, 32):  # 100 ms appends, as a microphone sends them
            await rt.send("input_audio_buffer.append", audio=pcm16_b64(part))
        started = await rt.until("input_audio_buffer.speech_started")
        stopped = await rt.until("input_audio_buffer.speech_stopped")
        committed = await rt.until("input_audio_buffer.committed")
        reply = await rt.reply()  # server VAD asks for the reply itself (create_response)
        await rt.close()
        return started, stopped, committed, reply

    started, stopped, committed, reply = run(go())
    assert 800 <= started["audio_start_ms"] <= 900  # the speech starts at 800 ms
    assert 2000 + 400 <= stopped["audio_end_ms"] <= 2000 + 400 + 200  # it ends at 2000 ms, + the silence
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    # The committed turn: 300 ms of prefix padding before the speech, up to where it stopped.
    first, last = (started["audio_start_ms"] - 300) * sr // 1000, stopped["audio_end_ms"] * sr // 1000
    text, pcm = chat_reference(openai_client(demo), [user_audio_wav(wav_b64(timeline[first:last], sr))], TOKENS)
    assert reply.transcript == text and reply.pcm == pcm


def test_two_turns_keep_the_history(demo):
    async def go():
        rt = await Realtime.open(demo, **MANUAL, max_output_tokens=TOKENS)
        await rt.say_text("Hi")
        first = await rt.response()
        await rt.say_text("Tell me more")
        second = await rt.response()
        await rt.close()
        return first, second

    first, second = run(go())
    client = openai_client(demo)
    assert first.transcript == chat_reference(client, [user_text("Hi")], TOKENS)[0]
    history = [user_text("Hi"), {"role": "assistant", "content": first.transcript}, user_text("Tell me more")]
    text, pcm = chat_reference(client, history, TOKENS)
    assert second.transcript == text and second.pcm == pcm


def test_many_sessions_at_once_equal_their_solo_runs(demo):
    prompts = ["Hello", "What is the capital of France?", "Sing me a song", "Count: 1 2 3 4 5"]

    async def one(prompt):
        rt = await Realtime.open(demo, **MANUAL, max_output_tokens=TOKENS)
        await rt.say_text(prompt)
        reply = await rt.response()
        await rt.close()
        return reply.transcript, reply.pcm

    async def solo():
        return [await one(p) for p in prompts]

    async def together():
        return await asyncio.gather(*(one(p) for p in prompts))

    alone = run(solo())
    assert len({t for t, _ in alone}) > 1  # the prompts do lead to different replies
    assert run(together()) == alone


@pytest.mark.parametrize("appends", [18, 1], ids=["streamed", "one-append"])
def test_barge_in_cancels_the_reply_and_cuts_the_history(demo, appends):
    """With one append, the speech starts and ends in the same event, before the cancelled reply
    has wound down: the turn's own response must still come, after the cancelled one's done."""
    sr = 16000
    interruption = np.concatenate([silence(0.2, sr), speech_like(0.8, sr, seed=7), silence(0.8, sr)])

    async def go():
        rt = await Realtime.open(demo, max_output_tokens=TOKENS,
                                 audio={"input": {"format": {"type": "audio/pcm", "rate": sr},
                                                  "turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}})
        await rt.say_text("Talk for a long time")
        await rt.send("response.create", response={"max_output_tokens": 64})
        long_reply = (await rt.until("response.created"))["response"]["id"]
        await rt.until("response.output_audio_transcript.delta")  # it is talking now
        for part in chunks(interruption, appends):
            await rt.send("input_audio_buffer.append", audio=pcm16_b64(part))
        cancelled = await rt.until("response.done")
        assert cancelled["response"]["id"] == long_reply, "the reply finished before the speech was heard"
        kinds = [e["type"] for e in rt.seen]
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
        truncated = next(e for e in rt.seen if e["type"] == "conversation.item.truncated")
        started = next(e for e in rt.seen if e["type"] == "input_audio_buffer.speech_started")
        stopped = await rt.first("input_audio_buffer.speech_stopped")
        answer = await rt.reply()  # to the interruption
        await rt.close()
        return cancelled["response"], truncated, started, stopped, answer

    cancelled, truncated, started, stopped, answer = run(go())
    assert cancelled["status"] == "cancelled" and cancelled["status_details"]["reason"] == "turn_detected", cancelled
    assert cancelled["output"][0]["status"] == "incomplete"
    # No audio had been played: nothing of the cancelled reply stays in the history.
    assert truncated["item_id"] == cancelled["output"][0]["id"] and truncated["audio_end_ms"] == 0
    assert cancelled["output"][0]["content"][0]["transcript"] == ""
    for stage in ("0", "1", "2"):  # the cancelled reply was aborted everywhere
        assert wait_until(lambda s=stage: demo.metric("vllm_omni:stage_num_requests", stage=s) == 0.0, 15.0)
    first, last = (started["audio_start_ms"] - 300) * sr // 1000, stopped["audio_end_ms"] * sr // 1000
    history = [user_text("Talk for a long time"), user_audio_wav(wav_b64(interruption[max(0, first):last], sr))]
    text, pcm = chat_reference(openai_client(demo), history, TOKENS)
    assert answer.transcript == text and answer.pcm == pcm


def test_truncate_keeps_what_was_heard(demo):
    async def go():
        rt = await Realtime.open(demo, **MANUAL, max_output_tokens=TOKENS)
        await rt.say_text("Say something")
        first = await rt.response()
        item = first.item["id"]
        audio_ms = len(first.pcm) // 2 * 1000 // 24000
        await rt.send("conversation.item.truncate", item_id=item, content_index=0, audio_end_ms=audio_ms + 500)
        too_far = await rt.error()
        await rt.send("conversation.item.truncate", item_id=item, content_index=0, audio_end_ms=audio_ms // 2)
        truncated = await rt.until("conversation.item.truncated")
        await rt.send("conversation.item.retrieve", item_id=item)
        kept = (await rt.until("conversation.item.retrieved"))["item"]["content"][0]["transcript"]
        await rt.say_text("And then?")
        second = await rt.response()
        await rt.close()
        return first, audio_ms, too_far, truncated, kept, second

    first, audio_ms, too_far, truncated, kept, second = run(go())
    assert too_far["param"] == "audio_end_ms"
    assert truncated["audio_end_ms"] == audio_ms // 2
    assert kept == cut_transcript(first.transcript, audio_ms // 2, audio_ms)
    assert first.transcript.startswith(kept) and len(kept) < len(first.transcript)
    history = [user_text("Say something")] + ([{"role": "assistant", "content": kept}] if kept else []) + \
              [user_text("And then?")]
    text, pcm = chat_reference(openai_client(demo), history, TOKENS)
    assert second.transcript == text and second.pcm == pcm


def test_a_dropped_socket_aborts_the_reply_in_every_stage(demo):
    before = demo.metric("vllm_omni:requests_total", endpoint="/v1/realtime", status="499") or 0.0

    async def go():
        rt = await Realtime.open(demo, **MANUAL)
        await rt.say_text("Go on and on")
        await rt.send("response.create", response={"max_output_tokens": 400})
        await rt.until("response.output_audio_transcript.delta")
        rt.ws.transport.abort()  # no close handshake: the network just goes away

    run(go())
    for stage in ("0", "1", "2"):
        assert wait_until(lambda s=stage: demo.metric("vllm_omni:stage_num_requests", stage=s) == 0.0, 15.0)
    assert wait_until(lambda: demo.metric("vllm_omni:requests_total", endpoint="/v1/realtime", status="499")
                      == before + 1, 10.0)


def test_bad_events_get_an_error_and_the_session_goes_on(demo):
    async def go():
        rt = await Realtime.open(demo, **MANUAL)
        errors = {}
        await rt.ws.send('{"type": "nonsense.event", "event_id": "ev_1"}')
        errors["unknown"] = await rt.error()
        await rt.ws.send("{not json")
        errors["json"] = await rt.error()
        await rt.send("input_audio_buffer.append", audio="%%% not base64 %%%")
        errors["base64"] = await rt.error()
        await rt.send("input_audio_buffer.append", audio=base64.b64encode(b"\x01\x02\x03").decode())
        errors["odd_bytes"] = await rt.error()
        too_long = speech_like(MAX_INPUT_AUDIO_S + 1, 24000)
        await rt.send("input_audio_buffer.append", audio=pcm16_b64(too_long))
        errors["too_long"] = await rt.error()
        await rt.send("session.update", session={"temperature": 0.5})
        errors["param"] = await rt.error()
        await rt.send("session.update", session={"audio": {"output": {"voice": "Nobody"}}})
        errors["voice"] = await rt.error()
        await rt.send("response.cancel")
        errors["cancel"] = await rt.error()
        await rt.send("input_audio_buffer.commit")
        errors["empty_commit"] = await rt.error()
        await rt.send("conversation.item.retrieve", item_id="item_missing")
        errors["missing"] = await rt.error()
        # After all that, the session still talks.
        await rt.say_text("Still there?")
        reply = await rt.response(max_output_tokens=2)
        await rt.close()
        return errors, reply

    errors, reply = run(go())
    assert errors["unknown"]["code"] == "unknown_event_type" and errors["unknown"]["event_id"] == "ev_1"
    assert errors["json"]["code"] == "invalid_json"
    assert errors["base64"]["code"] == "invalid_audio" and "base64" in errors["base64"]["message"]
    assert errors["odd_bytes"]["code"] == "invalid_audio"
    assert errors["too_long"]["code"] == "input_audio_buffer_full" and f"{MAX_INPUT_AUDIO_S} s" in errors["too_long"][
        "message"]
    assert errors["param"]["code"] == "unknown_parameter" and errors["param"]["param"] == "session.temperature"
    assert errors["voice"]["param"] == "session.audio.output.voice"
    assert errors["cancel"]["code"] == "response_cancel_not_active"
    assert errors["empty_commit"]["code"] == "input_audio_buffer_commit_empty"
    assert errors["missing"]["code"] == "item_not_found"
    assert all(e["type"] == "invalid_request_error" for e in errors.values())
    assert reply.response["status"] == "incomplete" and reply.transcript


def test_history_keeps_a_bounded_amount_of_user_audio(demo):
    seconds = 9  # three items: 27 s, over the server's 25 s bound

    async def go():
        rt = await Realtime.open(demo, **MANUAL)
        ids = []
        for i in range(3):
            await rt.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": pcm16_b64(speech_like(seconds, 24000, seed=i))}]})
            ids.append((await rt.until("conversation.item.added"))["item"]["id"])
        deleted = [e["item_id"] for e in rt.seen if e["type"] == "conversation.item.deleted"]
        await rt.close()
        return ids, deleted

    ids, deleted = run(go())
    assert 3 * seconds > MAX_HISTORY_AUDIO_S >= 2 * seconds
    assert deleted == ids[:1]


def test_voices_are_listed_and_picked(demo):
    listed = demo.get("/v1/audio/voices").json()
    assert listed["voices"] == ["Chelsie", "Ethan"] and "task_type" not in listed
    assert [(v["name"], v["kind"]) for v in listed["data"]] == [("Chelsie", "preset"), ("Ethan", "preset")]

    async def go():
        rt = await Realtime.open(demo, **MANUAL)
        session = await rt.update(audio={"output": {"voice": "ethan"}})
        await rt.say_text("Which voice?")
        reply = await rt.response(max_output_tokens=TOKENS)
        await rt.close()
        return session, reply

    session, reply = run(go())
    assert session["audio"]["output"]["voice"] == "Ethan"
    assert reply.response["audio"]["output"]["voice"] == "Ethan"
    text, pcm = chat_reference(openai_client(demo), [user_text("Which voice?")], TOKENS, voice="Ethan")
    assert reply.transcript == text and reply.pcm == pcm


def test_the_openai_sdk_realtime_client_talks_to_it(demo):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{demo.url}/v1", api_key="none", max_retries=0)
        async with client.realtime.connect(model=DEMO_SERVED_NAME) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None}}})
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello SDK"}]})
            await conn.response.create(response={"max_output_tokens": 3})
            seen, text = [], ""
            async for event in conn:
                seen.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.done":
                    return seen, text, event.response

    seen, text, response = run(go())
    assert seen[0] == "session.created" and "session.updated" in seen
    assert response.status == "incomplete" and response.usage.output_tokens == 3
    assert response.output[0].content[0].text == text
    assert text == chat_reference(openai_client(demo), [user_text("Hello SDK")], 3, modalities=["text"])[0]
