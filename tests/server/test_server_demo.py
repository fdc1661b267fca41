"""`vllm serve --omni` with no MODEL: the embedded tiny demo model answers with text and speech."""
from __future__ import annotations

import base64
import io

import openai
import soundfile as sf

from vllm_omni.entrypoints.cli.serve import DEMO_SERVED_NAME


def test_demo_model_answers_a_chat_request(demo_server):  # the session's (tests/conftest.py): fresh cache
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [DEMO_SERVED_NAME]
    resp = client.chat.completions.create(model=DEMO_SERVED_NAME, max_tokens=8,
                                          messages=[{"role": "user", "content": "Hello!"}])
    assert len(resp.choices) == 2  # text and speech
    assert resp.choices[0].message.content is not None and 0 < resp.usage.completion_tokens <= 8
    data, rate = sf.read(io.BytesIO(base64.b64decode(resp.choices[1].message.audio.data)))
    assert rate == 24000 and data.size > 0
