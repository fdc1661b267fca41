"""The realtime API: `GET /v1/realtime`, a WebSocket speaking OpenAI's Realtime (GA) events.

    endpoint.py        the socket: authentication, Origin, session bounds, the receive loop
    session.py         the session state machine (buffer, VAD, conversation, responses)
    response.py        one response: AsyncOmni deltas -> response.* events; cancel = abort
    conversation.py    items and the multi-turn history handed to the model; truncation
    session_config.py  the effective session configuration and session.update
    protocol.py        client events (pydantic), ProtocolError -> `error` events
    events.py          server events
    audio.py           input decoding and resampling (soxr), PCM16 output
    input_buffer.py    the uncommitted input audio
    vad.py             server VAD: Silero VAD + OpenAI's server_vad segmentation
    limits.py          RealtimeLimits and the --realtime-* flags

docs/realtime.md describes the supported events, limits, VAD and barge-in.
"""
