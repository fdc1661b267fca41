"""The OpenAI-compatible API server (`vllm-omni serve`).

    api_server.py           bind, build the app around one AsyncOmni, run uvicorn
    app.py                  routes, API-key and status-metrics middleware
    serving_chat.py         /v1/chat/completions (text + speech, SSE streaming)
    serving_completions.py  /v1/completions
    serving_base.py         shared: pipeline shape, checks, disconnect handling, SSE response
    protocol.py             request models (pydantic)
    accumulator.py          OmniRequestOutputs -> text / audio deltas and totals
    audio.py                wav / flac / pcm16 / mp3 / opus encoding
    media_fetch.py          the media gate per request: every media URL fetched before admission
    input_limits.py         the media and prompt caps' flags -> the server's MediaPolicy
    admission.py            bounded concurrency + bounded queue (429)
    errors.py, metrics.py   OpenAI error shape and statuses; Prometheus metrics
"""
